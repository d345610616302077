"""`ft.engine.core.step_times`: a step's kind from its scheduled rows, and the totals by kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ft.engine.core.step_times import STEP_KINDS, StepTimes, step_kind
from ft.engine.sched.scheduler import ScheduledWork


def seq(outputs: int) -> SimpleNamespace:
    return SimpleNamespace(output_ids=list(range(outputs)))


@pytest.mark.parametrize(("rows", "is_prefill", "kind"), [
    ([(seq(3), 1), (seq(1), 1)], False, "decode"),
    ([(seq(0), 37)], True, "prefill"),
    ([(seq(0), 1)], True, "prefill"),  # a one-token prompt
    ([(seq(2), 1), (seq(0), 512)], True, "mixed"),
    ([(seq(4), 9)], True, "prefill"),  # a preempted sequence recomputed: a chunk, though it has output
    ([(seq(4), 9), (seq(1), 1)], True, "mixed"),
], ids=["decode", "prompt", "one-token-prompt", "mixed", "recompute", "recompute-beside-decode"])
def test_step_kind(rows, is_prefill, kind):
    work = ScheduledWork([s for s, _ in rows], [n for _, n in rows], is_prefill)
    assert step_kind(work) == kind


def test_step_times_total_by_kind():
    times = StepTimes()
    assert times.count == dict.fromkeys(STEP_KINDS, 0) and times.seconds == dict.fromkeys(STEP_KINDS, 0.0)
    times.add("decode", 0.25)
    times.add("decode", 0.5)
    times.add("mixed", 1.0)
    assert times.count == {"decode": 2, "mixed": 1, "prefill": 0}
    assert times.seconds == {"decode": 0.75, "mixed": 1.0, "prefill": 0.0}
