"""CUDA graphs of decode steps: one per batch-size bucket, replayed over the model runner's
persistent buffers.

A decode step whose batch fits a bucket runs padded to that bucket (the padding rows repeat the
first sequence: same inputs, same slot, same page, so they write the same values to the same
places and change nothing). The first step of a bucket runs eagerly (it is the step's real
computation, and it compiles and warms every kernel), then the graph is captured over the same
buffers (capture records, it does not execute); later steps of that bucket replay it. All graphs
share one memory pool; each replay's logits are copied out before another graph runs.

A graph is valid while what it baked in stays put: the addresses of the buffers and of the pools
(the decode step reads the pools through Triton kernels only: pointers and strides, no bounds).
`key` carries them; a VMM or mmap rebuild keeps every address, so graphs survive it. When the key
changes (a reallocating rebuild, a buffer that had to grow) every graph is dropped and captured
again lazily, and the capture time is counted in `capture_s`.

Programmatic dependent launch (`ft.kernels.pdl`): with `pdl` (the model's `decode_graph_pdl`) and
`LaunchOptions.pdl` left at None, the step before a capture and the capture itself run with PDL in force,
so the graph's launches keep their programmatic edges; eager steps past the largest bucket and prefill
launch plainly. The kernels give the same bits either way (tests/gpu/test_flash_next_cuda.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Hashable

import torch

from ft.kernels.options import kernel_options, use_kernel_options

log = logging.getLogger("ft.engine")


def batch_buckets(max_bs: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """The decode graphs' batch sizes: `sizes` (--cuda-graph-bs) up to max_bs when given, else 1, 2, 4,
    8, 12, 16, then every 8 up to 64 and every 16 past it, up to max_bs (max_bs itself included). Why so fine: a padding row costs what a real row does (it repeats the first
    sequence): 0.25-0.42 ms a step on the 80B (H200, session 28: batch 10 in the 16-row graph 9.37
    ms a step, in a 12-row one 7.88; batch 24 in the 32-row graph 16.83, in a 24-row one 13.50). The
    graphs share one memory pool, sized by the largest, so a bucket more costs its capture at
    warm-up, not memory."""
    if sizes is not None:
        return sorted({b for b in sizes if 1 <= b <= max_bs})
    out = [b for b in (1, 2, 4, 8, 12, 16) if b <= max_bs] + list(range(24, min(64, max_bs) + 1, 8)) \
        + list(range(80, max_bs + 1, 16))
    if max_bs not in out:
        out.append(max_bs)
    return sorted(set(out))


class DecodeGraphs:
    """One graph per bucket of `batch_buckets(max_bs, sizes)`; `pdl`: capture with programmatic dependent
    launch unless `LaunchOptions.pdl` says otherwise (module docstring)."""

    def __init__(self, max_bs: int, pdl: bool = False, sizes: tuple[int, ...] | None = None) -> None:
        self.buckets = batch_buckets(max_bs, sizes)
        self.pdl = pdl
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._key: Hashable = None
        self.captures = 0  # graphs captured so far (tests and reports)
        self.replays = 0
        self.replay_s = 0.0  # host seconds inside graph.replay() (the launch, benchmarks)
        self.capture_s = 0.0
        self.disabled: str | None = None  # why graphs were turned off (a capture that failed)

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """Bucket `bucket`'s captured graph (None: not captured yet), for a benchmark that replays it back to
        back (`bench/decode.py --replay-span`): a replay reruns the step on the buffers as they are (a step
        with gated n-gram rows waits at its gate until let go: `RowsBuffer.release`)."""
        entry = self._graphs.get(bucket)
        return None if entry is None else entry[0]

    def bucket(self, b: int) -> int | None:
        """The smallest bucket holding b rows, None when b is over the largest."""
        return next((n for n in self.buckets if n >= b), None)

    def invalidate(self) -> None:
        """Drop every graph; the next capture takes a new memory pool. (torch counts a pool's graphs:
        once none is left while blocks allocated in it are still held, capturing into it again fails
        an allocator assertion, ``it->second->use_count > 0``: seen on the H200 in session 18 when
        the decode graphs were dropped and captured again in one process.)"""
        self._graphs.clear()
        self._pool = None

    def release(self) -> None:
        """Drop every graph and the graphs' memory pool (before a tensor-parallel rank leaves its
        process group: NCCL's teardown waits until no graph holds its collectives). Captures again
        on the next decode step."""
        self.invalidate()
        self._pool, self._key = None, None
        torch.cuda.synchronize()

    def will_replay(self, n: int, key: Hashable) -> bool:
        """Whether `run(n, key, ...)` replays a captured graph (else it computes eagerly and captures)."""
        return key == self._key and n in self._graphs

    def run(self, n: int, key: Hashable, forward: Callable[[], torch.Tensor | None],
            after_launch: Callable[[], None] | None = None) -> torch.Tensor | None:
        """The logits [n, V] of this step: replayed from bucket n's graph, or computed eagerly
        and captured for the next steps. `forward` reads only the persistent buffers. `after_launch`:
        called once the step is queued, right after the replay's launch (before anything else is queued
        or allocated: a step that waits on the host, `ft.memory.host_flag`, is let go there); before
        the forward where no graph is replayed."""
        if key != self._key:
            self.invalidate()
            self._key = key
        entry = self._graphs.get(n)
        if entry is None and after_launch is not None:
            after_launch()  # (the eager step and its capture must find the host's part done)
        if entry is not None:
            graph, out = entry
            t0 = time.perf_counter()
            graph.replay()
            self.replay_s += time.perf_counter() - t0
            self.replays += 1
            if after_launch is not None:
                after_launch()
            # NOTE: another bucket's replay may reuse the shared pool's memory (a worker rank of a
            # tensor-parallel engine computes no logits: None)
            return None if out is None else out.clone()
        with self.capture_launch():
            logits = forward()  # this step, eagerly: also the warm-up the capture needs
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with self.capture_launch(), torch.cuda.graph(graph, pool=self._pool):
                out = forward()
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the graph's pool
            # NOTE: this step's logits are already computed (eagerly): decoding goes on without graphs
            self.disabled = f"capturing the batch-{n} decode graph failed: {type(e).__name__}: {e}"
            log.warning("%s; decode steps run eagerly from now on", self.disabled)
            self.invalidate()
            return logits
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[n] = (graph, out)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return logits

    def capture_launch(self) -> contextlib.AbstractContextManager:
        """The kernel options a capture (and the eager step before it) runs under: PDL in force when
        this model's graphs take it and `LaunchOptions.pdl` is None (True or False: as it says)."""
        options = kernel_options()
        if self.pdl and options.launch.pdl is None:
            return use_kernel_options(options.with_(**{"launch.pdl": True}))
        return contextlib.nullcontext()
