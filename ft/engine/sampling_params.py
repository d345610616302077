"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from ft.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. max_new_tokens None: up to the context limit.

    stop_token_ids end generation after emitting one of them (the checkpoint's EOS ids are added
    unless ignore_eos); stop strings end it when the text contains one (the text is cut before it).
    """

    max_new_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
