"""CUDA graphs of short prefills: the whole forward of a prefill of up to `--prefill-graph-max-tokens`
tokens (one sequence; up to `MAX_SEQS`), padded to a token bucket, replayed in pieces around the
attention layers' cores.

Why: a 1K-token prefill of the flagship is ~2,500 kernel launches whose host work (~28 us each on
a fast vCPU, ~55 on a slow one) outlasts its 58 ms of GPU work, so its time to first token was the
host's (70-150 ms by process; bench/RESULTS.md). A replay launches a graph per piece instead.

What is in the graphs and what is not. Everything a prefill computes row by row (embedding,
norms, projections, rotary, the MoE, the lm_head on the last token) and the Gated DeltaNet layers
(their conv1d and chunked delta rule read the sequence bounds from device tensors and skip the
padding tokens, past cu_seqlens[-1]) run inside the graphs over the bucket's padded rows. The
attention layers' cores (writing the chunk's K/V into its pages, attention over the cached
prefix and the chunk, the output gate) depend on the chunk's start and page list, host values
that change from prompt to prompt: they run eagerly between the pieces, on the real rows, reading
the static buffers the previous piece wrote (q, k, v, gate) and writing one the next piece reads
(so the graph of piece i + 1 starts where the core of layer i left its output). A bucket with L
attention layers is L + 1 graphs and L eager cores (~6 launches each).

Padding rows repeat nothing: their token id 0 and positions after the chunk's go through the
row-wise layers (finite values, discarded); the cores and the delta rule never see them, their
attention output rows are zero. So a padded prefill computes the real rows exactly as an unpadded
prefill of the same row count would; against an unpadded prefill of n rows, results may differ in
the last bits where a kernel picks its tiles by the row count (tokens are checked on the device).

Capture: the first prefill of a bucket runs eagerly, padded (its real result, and the warm-up that
compiles every kernel at the bucket's shapes), then the pieces are captured (recorded, not run);
later prefills of that bucket replay them. All buckets share one memory pool (they never run
concurrently) and one set of core buffers sized for the largest bucket. Graphs are keyed on the
addresses they read (model runner buffers, mamba and expert pools); a change drops them all. A
capture that fails turns prefill graphs off with a warning (the step's result is already computed).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable

import torch

from ft.engine.base.step_inputs import StepInputs

log = logging.getLogger("ft.engine")

BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""Token buckets a prefill pads to (those up to the engine's limit)."""
MAX_SEQS = 1
"""Sequences a graphed prefill may hold (a batch of several: graphs per (bucket, sequence count), the
Gated DeltaNet kernels' grids depend on the count). 1 until several are verified on the device
(the CPU tests run up to 4 through the same padding and cores)."""


def prefill_buckets(max_tokens: int) -> list[int]:
    """The buckets up to max_tokens, max_tokens itself the last one (empty when max_tokens < 1)."""
    if max_tokens < 1:
        return []
    out = [b for b in BUCKETS if b < max_tokens]
    return out + [max_tokens]


def padded_inputs(inp: StepInputs, rows: int) -> StepInputs:
    """A prefill's inputs padded to `rows` tokens for its prefill graphs: token id 0 at the positions
    after the last chunk's; the sequences keep their real lengths (the attention cores and the
    delta rule read only their tokens)."""
    pad = rows - len(inp.ids)
    last = inp.pos[-1] if inp.pos else -1
    return StepInputs(inp.kind, inp.ids + [0] * pad, inp.pos + list(range(last + 1, last + 1 + pad)), inp.seqs,
                      inp.logit_index, inp.mamba_slots, forced=inp.forced, calibrate_kv=inp.calibrate_kv)


class CoreBuffers:
    """The static tensors an attention core reads and writes between two pieces, for up to `rows`
    tokens: q [rows, Hq, D], k and v [rows, Hkv, D], gate and out [rows, Hq * D] (out starts at zero;
    a core writes its prefill's real rows only, so the padding rows keep finite values). Shared by every attention layer and every bucket: a
    replay runs piece, core, piece, ... in order, so one layer's core is done with them before the
    next layer's piece writes them."""

    def __init__(self, rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rows = rows
        self.q = torch.empty(rows, heads, head_dim, dtype=dtype, device=device)
        self.k = torch.empty(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.gate = torch.empty(rows, heads * head_dim, dtype=dtype, device=device)
        self.out = torch.zeros(rows, heads * head_dim, dtype=dtype, device=device)

    @staticmethod
    def nbytes(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return rows * head_dim * (3 * heads + 2 * kv_heads) * torch.finfo(dtype).bits // 8

    def views(self, t: int) -> tuple[torch.Tensor, ...]:
        return self.q[:t], self.k[:t], self.v[:t], self.gate[:t], self.out[:t]


class _Capture:
    """`ForwardBatch.pieces` while a bucket is captured: each attention core ends the current graph
    (after copying its inputs into the core buffers, inside the graph) and starts the next; the
    core itself is recorded, not run."""

    def __init__(self, buffers: CoreBuffers, pool, rows: int) -> None:
        self.buffers, self.pool, self.rows = buffers, pool, rows
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cores: list[tuple[Callable, tuple]] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        graph, self.graph = self.graph, None
        graph.capture_end()
        self.graphs.append(graph)

    def core(self, fn: Callable, kv: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             gate: torch.Tensor) -> torch.Tensor:
        bq, bk, bv, bg, out = self.buffers.views(self.rows)
        for dst, src in ((bq, q), (bk, k), (bv, v), (bg, gate)):
            dst.copy_(src)
        self.end()
        self.cores.append((fn, (kv, bq, bk, bv, bg)))
        self.begin()
        return out


class PrefillGraphs:
    def __init__(self, max_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_seqs: int = MAX_SEQS) -> None:
        self.buckets = prefill_buckets(max_tokens)
        self.max_seqs = max_seqs
        self._dims = (heads, kv_heads, head_dim, dtype, device)
        self._buffers: CoreBuffers | None = None
        # (bucket, sequences) -> the pieces' graphs, the cores between them, the logits
        self._graphs: dict[tuple[int, int], tuple[list[torch.cuda.CUDAGraph], list[tuple[Callable, tuple]],
                                                  torch.Tensor]] = {}
        self._pool = None
        self._key: Hashable = None
        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0
        self.reserved_bytes = 0  # growth of the allocator's reserved memory over the captures (their pool)
        self.disabled: str | None = None  # why prefill graphs were turned off (a capture that failed)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket of at least n tokens, None when n is over the largest."""
        return next((b for b in self.buckets if b >= n), None)

    def rows_for(self, inp: StepInputs) -> int | None:
        """The bucket a prefill's inputs replay, or None (eager): up to `max_seqs` sequences, their last
        positions' logits only, no KV calibration, no routing trace and no paged n-gram rows (their
        inputs are not in the graphs' buffers), and not one token per sequence (a prompt after a full
        prefix hit): such a batch, unpadded, takes the recurrent decode step in its Gated DeltaNet
        layers, padded the chunked form (other bf16 roundings, other greedy tokens on a test model)."""
        n = len(inp.seqs)
        if self.disabled or not 1 <= n <= self.max_seqs or len(inp.logit_index) != n or len(inp.ids) <= n \
                or inp.calibrate_kv or inp.forced is not None or inp.ngram_rows is not None:
            return None
        return self.bucket(len(inp.ids))

    def invalidate(self) -> None:
        """Drop every graph; the next capture takes a new memory pool (as `DecodeGraphs.invalidate`
        says why: torch may refuse a capture into a pool whose graphs are all gone)."""
        self._graphs.clear()
        self._pool = None

    def release(self) -> None:
        """Drop every graph, the shared pool and the core buffers (captured again when needed)."""
        self.invalidate()
        self._pool, self._key, self._buffers = None, None, None
        torch.cuda.synchronize()

    def run(self, rows: int, key: Hashable, batch, forward: Callable[[], torch.Tensor | None],
            kv_layer: Callable[[int], tuple]) -> torch.Tensor | None:
        """The logits of this prefill: replayed from bucket `rows`' graphs, or computed eagerly (padded
        to `rows`) and captured for the next prefills of that bucket. `batch` is this step's
        `ForwardBatch` over the runner's persistent buffers (padded to `rows`); `forward()` runs
        the model on it and reads `batch.pieces` (None: eager). `kv_layer(i)` is the KV pool's
        attention layer i now (`KVPool.layer`): a replay hands each core the pool's current tensors,
        not the ones of the capture (a rebuild may have resized or moved them; the graphs never
        read the KV pool, so they stay valid)."""
        if key != self._key:
            self.invalidate()
            self._key = key
        entry = self._graphs.get((rows, len(batch.seqs)))
        if entry is not None:
            graphs, cores, out = entry
            for i, graph in enumerate(graphs):
                graph.replay()
                if i < len(cores):
                    fn, (_, q, k, v, gate) = cores[i]
                    fn(batch, kv_layer(i), q, k, v, gate, out=self._buffers.out[:rows])
            self.replays += 1
            return None if out is None else out.clone()
        batch.pieces = None
        logits = forward()  # this step, eagerly and padded: also the warm-up the capture needs
        t0 = time.perf_counter()
        if self._buffers is None:
            heads, kv_heads, head_dim, dtype, device = self._dims
            self._buffers = CoreBuffers(self.buckets[-1], heads, kv_heads, head_dim, dtype, device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        capture = _Capture(self._buffers, self._pool, rows)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                capture.begin()
                try:
                    batch.pieces = capture
                    out = forward()
                finally:
                    batch.pieces = None
                    if capture.graph is not None:
                        capture.end()
        except Exception as e:  # noqa: BLE001 - e.g. a host sync inside the forward, out of memory
            self.disabled = f"capturing the {rows}-token prefill graphs failed: {type(e).__name__}: {e}"
            log.warning("%s; prefills run eagerly from now on", self.disabled)
            self.invalidate()
            torch.cuda.current_stream().wait_stream(stream)
            return logits
        torch.cuda.current_stream().wait_stream(stream)
        # the cores come in the KV pool's layer order (a replay looks each one's KV up by its index)
        for i, (_, (kv, *_)) in enumerate(capture.cores):
            if [t.data_ptr() for t in kv if t is not None] != [t.data_ptr() for t in kv_layer(i) if t is not None]:
                self.disabled = f"prefill graphs: attention core {i} does not read KV layer {i}"
                log.warning("%s; prefills run eagerly from now on", self.disabled)
                self.invalidate()
                return logits
        self._graphs[(rows, len(batch.seqs))] = (capture.graphs, capture.cores, out)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        self.reserved_bytes += max(0, torch.cuda.memory_reserved() - reserved)
        log.info("prefill graphs: the %d-token bucket captured (%d graphs) in %.2f s; %.0f MiB reserved by all "
                 "captures so far", rows, len(capture.graphs), time.perf_counter() - t0, self.reserved_bytes / 2**20)
        return logits
