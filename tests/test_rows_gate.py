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
