"""A stream waiting on a flag in pinned host memory (`ft.memory.host_flag.HostFlag`), eagerly and inside a
CUDA graph, and the gated rows of a decode step (`ft.engine.worker.buffers.RowsBuffer`): the device's work
after the wait does not run until the host sets the flag, then sees what the host wrote before it."""

from __future__ import annotations

import time

import pytest
import torch

from ft.engine.worker.buffers import RowsBuffer
from ft.memory.host_flag import HostFlag

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _still_waiting(stream: torch.cuda.Stream, seconds: float = 0.05) -> bool:
    time.sleep(seconds)
    return not stream.query()


def test_work_after_the_wait_runs_once_the_host_sets_the_flag():
    flag = HostFlag(DEV)
    assert flag.works()  # (the check the runner makes before it gates a step)
    out = torch.zeros(4, device=DEV)
    stream = torch.cuda.current_stream()
    flag.pass_when_set()
    out.fill_(7.0)
    assert _still_waiting(stream) and not flag.is_set
    flag.set()
    torch.cuda.synchronize()
    assert out.tolist() == [7.0] * 4 and not flag.is_set  # (passed and cleared by the device)
    flag.pass_when_set()  # and again: the clear left it ready for the next step
    out.fill_(9.0)
    assert _still_waiting(stream)
    flag.set()
    torch.cuda.synchronize()
    assert out.tolist() == [9.0] * 4


def test_a_graph_replay_waits_for_the_host_and_reads_what_it_wrote_before_the_flag():
    flag = HostFlag(DEV)
    src = torch.zeros(1024, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.zeros(1024, dtype=torch.bfloat16, device=DEV)
    y = torch.zeros(1024, dtype=torch.bfloat16, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # (records the wait and the clear: nothing runs here)
        flag.pass_when_set()
        dst.copy_(src, non_blocking=True)
        torch.mul(dst, 2, out=y)
    for step in range(3):
        graph.replay()  # launched before the host has written this step's values
        assert _still_waiting(torch.cuda.current_stream())
        src.copy_(torch.arange(1024, dtype=torch.bfloat16) + step)
        flag.set()
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), (torch.arange(1024, dtype=torch.bfloat16) + step) * 2)


def test_gated_rows_staged_after_the_launch_reach_the_step():
    rows = RowsBuffer(32, 160, torch.bfloat16, DEV)
    assert rows.gated
    view, gate = rows.gated_view(8)
    assert rows.owed
    out = torch.zeros(8, 160, dtype=torch.bfloat16, device=DEV)
    gate()
    out.copy_(view)
    want = torch.randn(8, 160).to(torch.bfloat16)
    rows.stage(lambda: want)  # (read by a callable: the flag is set whatever it does)
    rows.mark()
    torch.cuda.synchronize()
    assert not rows.owed and torch.equal(out.cpu(), want)


def test_a_failed_step_staged_before_its_gate_leaves_the_next_gate_waiting():
    rows = RowsBuffer(32, 160, torch.bfloat16, DEV)
    rows.gated_view(4)
    rows.stage(torch.ones(4, 160, dtype=torch.bfloat16))  # set, and no pass queued: the step failed before its gate
    assert rows.flag.is_set
    rows.settle()
    assert not rows.flag.is_set and not rows.owed
    view, gate = rows.gated_view(4)  # the next step: its gate queued before its rows are staged
    out = torch.zeros(4, 160, dtype=torch.bfloat16, device=DEV)
    gate()
    out.copy_(view)
    assert _still_waiting(torch.cuda.current_stream())  # (it did not pass on the failed step's set)
    want = torch.randn(4, 160).to(torch.bfloat16)
    rows.stage(want)
    rows.mark()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)


def test_settle_lets_a_queued_unstaged_gate_go():
    rows = RowsBuffer(32, 160, torch.bfloat16, DEV)
    _, gate = rows.gated_view(4)
    gate()  # queued; the step then failed before its rows were read
    rows.settle()  # (returns: the pass was let go, then the stream drained)
    assert torch.cuda.current_stream().query() and not rows.flag.is_set and not rows.owed
