"""A decode step's gated n-gram rows (`ft.engine.worker.buffers.RowsBuffer`): the contract that keeps a step
launched before its rows from waiting forever, on the CPU with a stand-in for the host flag (the device's
side: tests/gpu/test_host_flag_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from ft.engine.worker.buffers import RowsBuffer

CPU = torch.device("cpu")


class RecordingFlag:
    """Stands in for `ft.memory.host_flag.HostFlag`: counts the passes queued and the sets."""

    def __init__(self) -> None:
        self.passes = self.sets = 0

    def pass_when_set(self) -> None:
        self.passes += 1

    def set(self) -> None:
        self.sets += 1


def _gated(capacity: int = 8) -> tuple[RowsBuffer, RecordingFlag]:
    rows = RowsBuffer(capacity, 4, torch.float32, CPU)
    assert not rows.gated  # (no flag without CUDA)
    rows.flag = RecordingFlag()
    return rows, rows.flag


def test_a_staged_step_reads_its_rows_through_the_gate():
    rows, flag = _gated()
    view, gate = rows.gated_view(3)
    assert rows.owed and view.shape == (3, 4)
    want = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rows.stage(want)
    assert not rows.owed and flag.sets == 1
    gate()  # (on a device: the stream's wait, then the copy)
    assert flag.passes == 1 and torch.equal(view, want)


def test_the_flag_is_set_even_when_reading_the_rows_fails():
    rows, flag = _gated()
    rows.gated_view(2)

    def unreadable() -> torch.Tensor:
        raise OSError("the table's file went away")

    with pytest.raises(OSError, match="went away"):
        rows.stage(unreadable)
    assert flag.sets == 1 and not rows.owed  # the launched step goes on (its output is dropped with the error)


def test_a_gated_step_larger_than_the_buffer_is_refused():
    rows, _ = _gated(capacity=4)
    with pytest.raises(ValueError, match="5 rows"):
        rows.gated_view(5)
    assert not rows.owed


class PassingFlag(RecordingFlag):
    """A flag the stand-in device clears once the host has looked at it set; after `stuck` sets, never."""

    def __init__(self, stuck: int | None = None) -> None:
        super().__init__()
        self.state, self.stuck = 0, stuck

    def set(self) -> None:
        super().set()
        self.state = 1

    @property
    def is_set(self) -> bool:
        if self.state and (self.stuck is None or self.sets <= self.stuck):
            self.state = 0  # (the device passed the gate and cleared it)
            return True
        return bool(self.state)


def test_release_lets_queued_steps_go_one_after_another():
    rows = RowsBuffer(4, 4, torch.float32, CPU)
    rows.flag = PassingFlag()
    rows.release(3)
    assert rows.flag.sets == 3


def test_release_gives_up_on_a_step_that_never_passes():
    rows = RowsBuffer(4, 4, torch.float32, CPU)
    rows.flag = PassingFlag(stuck=1)
    with pytest.raises(RuntimeError, match="step 2 of 3 did not pass"):
        rows.release(3, timeout_s=0.05)


class DeviceFlag(RecordingFlag):
    """A flag with the device's side played in order: a queued pass consumes the set it finds (or waits for the
    next one: `waiting`), as the stream's wait-then-clear does."""

    def __init__(self) -> None:
        super().__init__()
        self.state, self.waiting = 0, 0

    def pass_when_set(self) -> None:
        super().pass_when_set()
        if self.state:
            self.state = 0
        else:
            self.waiting += 1

    def set(self) -> None:
        super().set()
        if self.waiting:
            self.waiting -= 1
        else:
            self.state = 1

    def clear(self) -> None:
        self.state = 0

    @property
    def is_set(self) -> bool:
        return bool(self.state)


def test_a_step_staged_then_failed_before_its_gate_leaves_no_set_for_the_next_step():
    rows = RowsBuffer(8, 4, torch.float32, CPU)
    rows.flag = flag = DeviceFlag()
    rows.gated_view(2)
    rows.stage(torch.ones(2, 4))  # (a step whose ids were known: staged before its launch)
    assert flag.is_set  # ... and it failed before its forward queued the gate
    rows.settle()
    assert not flag.is_set and not rows.owed
    # the next step, overlapped: its gate queued before its rows; it must wait for them, not pass on a stale set
    _, gate = rows.gated_view(2)
    gate()
    assert flag.waiting == 1
    rows.stage(torch.full((2, 4), 7.0))
    assert flag.waiting == 0 and not flag.is_set


def test_a_step_whose_gate_was_queued_unstaged_is_let_go_when_it_fails():
    rows = RowsBuffer(8, 4, torch.float32, CPU)
    rows.flag = flag = DeviceFlag()
    _, gate = rows.gated_view(2)
    gate()  # queued, waiting; then the step failed before its rows were read
    rows.settle()
    assert flag.sets == 1 and flag.waiting == 0 and not flag.is_set and not rows.owed


def test_settle_is_a_no_op_after_a_step_that_passed():
    rows = RowsBuffer(8, 4, torch.float32, CPU)
    rows.flag = flag = DeviceFlag()
    _, gate = rows.gated_view(2)
    rows.stage(torch.ones(2, 4))
    gate()
    rows.settle()
    assert flag.sets == 1 and not flag.is_set and flag.waiting == 0
