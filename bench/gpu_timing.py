"""GPU timing helpers for the benchmarks: CUDA-graph replay over calls that read rotated copies.

Decode kernels run for a few microseconds, shorter than one eager launch from Python, and the
engine replays them in CUDA graphs; so the benchmarks time a captured sequence of calls and
divide. Each call in the sequence reads its own copy of the weights (`copies_for`), enough
copies that a pass reads several times the 50 MB L2: every call reads HBM, as in a real decode
step where the next layer's weights are not in L2.
"""

from __future__ import annotations

import statistics

import torch

L2_BYTES = 50 * 2**20
COPY_CEILING_GBS = 4300.0  # measured device-to-device copy on the H200 (shared/reference/h200-ceilings.md)


def copies_for(nbytes: int, target: int = 4 * L2_BYTES, most: int = 512) -> int:
    """How many copies of an operand of nbytes make one pass over all of them read `target` bytes."""
    return max(1, min(most, -(-target // max(nbytes, 1))))


def captured(calls: list) -> torch.cuda.CUDAGraph:
    """`calls` (zero-argument callables, each one GPU op sequence) run once on a side stream (compile,
    allocate), then captured in order into one CUDA graph, replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:  # compile, allocate
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(calls: list, replays: int = 20, trials: int = 5) -> float:
    """Median microseconds per call of `calls` (zero-argument callables, each one GPU op sequence),
    captured once into a CUDA graph in order and replayed `replays` times per trial."""
    graph = captured(calls)
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    del graph
    return statistics.median(times)


def kernel_us(calls: list, replays: int = 5) -> str:
    """Mean GPU microseconds per call of each kernel that `calls` launch (their graph replayed under
    torch.profiler), as "name us; name us"."""
    from torch.profiler import ProfilerActivity, profile

    graph = captured(calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    n = replays * len(calls)
    parts = [f"{e.key[:40]} {e.self_device_time_total / n:.1f} us" for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    del graph
    return "; ".join(parts)


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN (e.g. unwritten, NaN-poisoned outputs) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
