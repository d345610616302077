"""Wall time the engine thread spends in steps, by the kind of step (`StepTimes`): what a serving
run's time is made of. `/metrics` exports it (`ft_engine_steps_total{kind}`,
`ft_engine_step_seconds_total{kind}`) and `bench/serve.py` prints each level's split from it.

Kinds (`StepShape.kind`, from a step's rows before it runs): "decode", every row of the step decodes one token; "prefill", every row is a
prompt chunk; "mixed", a prompt chunk beside decoding rows (the chunked prefill that keeps running
streams moving). A step's time is `Engine.step`'s wall time: with overlapped decode a decode step
returns the tokens of the step queued before it, so its time is the host's wait for that step
(the device's time once the host keeps ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

from ft.engine.sched.scheduler import ScheduledWork

__all__ = ["STEP_KINDS", "StepShape", "StepTimes"]

STEP_KINDS = ("decode", "mixed", "prefill")


@dataclass(frozen=True)
class StepShape:
    """A step's rows: prompt chunks, their tokens, and rows that decode one token."""

    prompts: int = 0
    prompt_tokens: int = 0
    decode_rows: int = 0

    @classmethod
    def of(cls, work: ScheduledWork) -> "StepShape":
        """The shape of scheduled work, before it runs: a row decodes when it adds one token to a sequence that
        has output already (a preempted sequence's recompute adds its tokens as a prompt chunk)."""
        if not work.is_prefill:
            return cls(decode_rows=len(work.seqs))
        decoding = sum(1 for seq, n in zip(work.seqs, work.num_tokens) if n == 1 and seq.output_ids)
        tokens = sum(n for seq, n in zip(work.seqs, work.num_tokens) if not (n == 1 and seq.output_ids))
        return cls(len(work.seqs) - decoding, tokens, decoding)

    @property
    def kind(self) -> str:
        """"decode" (no prompt chunk), "prefill" (no decoding row) or "mixed"."""
        if not self.prompts:
            return "decode"
        return "mixed" if self.decode_rows else "prefill"

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.decode_rows

    def text(self) -> str:
        rows = f"{self.decode_rows} decoding row{'s' * (self.decode_rows != 1)}"
        if not self.prompts:
            return rows
        prompts = f"{self.prompts} prompt{'s' * (self.prompts != 1)} ({self.prompt_tokens:,} tokens)"
        return f"{prompts} beside {rows}" if self.decode_rows else prompts


class StepTimes:
    """Steps and their wall seconds by kind, totals since the engine started (engine thread only;
    readers take copies through `EngineStats`)."""

    def __init__(self) -> None:
        self.count = dict.fromkeys(STEP_KINDS, 0)
        self.seconds = dict.fromkeys(STEP_KINDS, 0.0)

    def add(self, kind: str, seconds: float) -> None:
        self.count[kind] += 1
        self.seconds[kind] += seconds
