"""The rows of a step's logits that sequences asked logprobs of (details module of the model runner)."""

from __future__ import annotations

import torch

from ft.engine.base.sampling_params import TokenLogprob
from ft.engine.base.sequence import Sequence


class LogitPlan:
    """A prefill step whose model output holds more rows than sequences (prompt logprobs): the row
    of each sequence's last position (sampling), the rows whose next token is a prompt token and
    those tokens, and per sequence (sequence, first prompt position predicted, how many)."""

    def __init__(self, sample_rows: torch.Tensor, prompt_rows: torch.Tensor, prompt_targets: torch.Tensor,
                 spans: list[tuple[Sequence, int, int]]) -> None:
        self.sample_rows, self.prompt_rows, self.prompt_targets, self.spans = sample_rows, prompt_rows, prompt_targets, spans


def logprob_entry(token: int, own: list[float], top_v: list[float], top_i: list[float], j: int, k: int, kk: int) -> TokenLogprob:
    """Row j of the host copies (top lists flat with k per row) as a TokenLogprob with kk alternatives."""
    top = tuple((int(top_i[j * k + q]), top_v[j * k + q]) for q in range(kk))
    return TokenLogprob(int(token), own[j], top)
