"""Wall time the engine thread spends in steps, by the kind of step (`StepTimes`): what a serving
run's time is made of. `/metrics` exports it (`ft_engine_steps_total{kind}`,
`ft_engine_step_seconds_total{kind}`) and `bench/serve.py` prints each level's split from it.

Kinds (`step_kind`): "decode", every row of the step decodes one token; "prefill", every row is a
prompt chunk; "mixed", a prompt chunk beside decoding rows (the chunked prefill that keeps running
streams moving). A step's time is `Engine.step`'s wall time: with overlapped decode a decode step
returns the tokens of the step queued before it, so its time is the host's wait for that step
(the device's time once the host keeps ahead).
"""

from __future__ import annotations

from ft.engine.sched.scheduler import ScheduledWork

__all__ = ["STEP_KINDS", "StepTimes", "step_kind"]

STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(work: ScheduledWork) -> str:
    """The kind of a scheduled step, before it runs: a row decodes when it adds one token to a sequence
    that has output already (a preempted sequence's recompute adds its tokens as a prompt chunk)."""
    if not work.is_prefill:
        return "decode"
    decoding = any(n == 1 and seq.output_ids for seq, n in zip(work.seqs, work.num_tokens))
    prefilling = any(not (n == 1 and seq.output_ids) for seq, n in zip(work.seqs, work.num_tokens))
    if decoding and prefilling:
        return "mixed"
    return "decode" if decoding else "prefill"


class StepTimes:
    """Steps and their wall seconds by kind, totals since the engine started (engine thread only;
    readers take copies through `EngineStats`)."""

    def __init__(self) -> None:
        self.count = dict.fromkeys(STEP_KINDS, 0)
        self.seconds = dict.fromkeys(STEP_KINDS, 0.0)

    def add(self, kind: str, seconds: float) -> None:
        self.count[kind] += 1
        self.seconds[kind] += seconds
