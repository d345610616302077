"""`ft.engine.core.step_times`: a step's shape and kind from its scheduled rows, and the totals by kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ft.engine.core.step_times import STEP_KINDS, StepShape, StepTimes
from ft.engine.sched.scheduler import ScheduledWork


def seq(outputs: int) -> SimpleNamespace:
    return SimpleNamespace(output_ids=list(range(outputs)))


@pytest.mark.parametrize(("rows", "is_prefill", "kind", "shape"), [
    ([(seq(3), 1), (seq(1), 1)], False, "decode", (0, 0, 2)),
    ([(seq(0), 37)], True, "prefill", (1, 37, 0)),
    ([(seq(0), 1)], True, "prefill", (1, 1, 0)),  # a one-token prompt
    ([(seq(2), 1), (seq(0), 512)], True, "mixed", (1, 512, 1)),
    ([(seq(4), 9)], True, "prefill", (1, 9, 0)),  # a preempted sequence recomputed: a chunk, though it has output
    ([(seq(4), 9), (seq(1), 1)], True, "mixed", (1, 9, 1)),
], ids=["decode", "prompt", "one-token-prompt", "mixed", "recompute", "recompute-beside-decode"])
def test_step_shape_and_kind(rows, is_prefill, kind, shape):
    work = ScheduledWork([s for s, _ in rows], [n for _, n in rows], is_prefill)
    got = StepShape.of(work)
    assert got.kind == kind and (got.prompts, got.prompt_tokens, got.decode_rows) == shape


def test_step_times_total_by_kind():
    times = StepTimes()
    assert times.count == dict.fromkeys(STEP_KINDS, 0) and times.seconds == dict.fromkeys(STEP_KINDS, 0.0)
    times.add("decode", 0.25)
    times.add("decode", 0.5)
    times.add("mixed", 1.0)
    assert times.count == {"decode": 2, "mixed": 1, "prefill": 0}
    assert times.seconds == {"decode": 0.75, "mixed": 1.0, "prefill": 0.0}
