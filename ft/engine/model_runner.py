"""The model runner: scheduled work in, one sampled token per finished sequence out.

It prepares the batch for the model in persistent device buffers, runs it over the pools, and
samples on the device. `Engine.step` only sees `run(work) -> token ids`; where the batch lives
and how it is sampled (and later, which CUDA graph replays it) is this module's business.

Buffers: every input of a step (token ids, positions, sequence lengths, last-token indices,
mamba slots, the page table, the sampling parameters) lives in a device tensor allocated once,
sized for the largest batch, with a host staging twin (pinned on CUDA). A step writes its values
into the host prefix and copies that prefix to the device in one copy per buffer, so the
addresses the model reads stay fixed from step to step (what a CUDA graph capture needs). The
`ForwardBatch` the model gets is made of views of these buffers.
"""

from __future__ import annotations

import torch

from ft.engine.decode_graphs import DecodeGraphs
from ft.engine.sampler import SamplingBatch, sample
from ft.kernels.backend import debug_checks
from ft.kernels.moe import runs_triton
from ft.engine.scheduler import ScheduledWork
from ft.engine.sequence import Sequence
from ft.memory.cache_pools import CachePools
from ft.model.forward_batch import DecodeMeta, ForwardBatch, SeqSlice


class StagedBuffer:
    """A persistent device buffer [capacity] and its host staging twin (pinned on CUDA)."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._alloc(max(1, capacity))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.device_buffer = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self.host = torch.zeros(capacity, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self._host_np = self.host.numpy()

    def reserve(self, n: int) -> None:
        # NOTE: the only reallocation: a batch larger than the buffer (the constructor's sizes
        # were too small). The address changes, so a captured graph would have to be recaptured.
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))

    def load(self, values) -> torch.Tensor:
        """Copy `values` (a list of numbers) into the buffer's prefix; returns that prefix [n]."""
        n = len(values)
        self.reserve(n)
        self._host_np[:n] = values
        out = self.device_buffer[:n]
        out.copy_(self.host[:n], non_blocking=True)
        return out


class PageTableBuffer:
    """The page table [rows, cols] int64 of a batch: row i holds sequence i's KV pages.

    Only the block [B, w] a batch uses travels: packed in the host staging, copied in one copy to
    a flat device scratch, then spread into the table's rows on the device (fixed addresses)."""

    def __init__(self, rows: int, cols: int, device: torch.device) -> None:
        self.device = device
        self._alloc(max(1, rows), max(1, cols))

    def _alloc(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.table = torch.zeros(rows, cols, dtype=torch.int64, device=self.device)
        self._scratch = torch.zeros(rows * cols, dtype=torch.int64, device=self.device)
        self._host = torch.zeros(rows * cols, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()

    def reserve(self, rows: int, cols: int) -> None:
        # NOTE: reallocates (new addresses) only when a batch exceeds the constructor's sizes.
        if rows > self.rows or cols > self.cols:
            self._alloc(max(rows, self.rows), max(cols, self.cols))

    def load_rows(self, pages: list[list[int]]) -> torch.Tensor:
        """Write each sequence's pages into its row; returns table[:B] (its full width)."""
        self.load(pages)
        return self.table[: len(pages)]

    def load(self, pages: list[list[int]]) -> list[torch.Tensor]:
        """Write each sequence's pages into its row; returns the views table[i, :len(pages[i])]."""
        b, w = len(pages), max(1, max(map(len, pages), default=0))
        self.reserve(b, w)
        block = self._host_np[: b * w].reshape(b, w)
        for i, row in enumerate(pages):
            block[i, : len(row)] = row
        self._scratch[: b * w].copy_(self._host[: b * w], non_blocking=True)
        self.table[:b, :w].copy_(self._scratch[: b * w].view(b, w))
        return [self.table[i, : len(row)] for i, row in enumerate(pages)]


class ModelRunner:
    """Owns the step's device buffers; `run(work)` is one forward pass and one sampling.

    Sizes: up to `max_running_requests` sequences, `max(max_prefill_length, max_running_requests)`
    tokens and `max_pages_per_seq` KV pages per sequence (ceil(context_limit / page_size)); the
    defaults start at one and grow with the first batches.
    """

    def __init__(
        self,
        model,
        pools: CachePools,
        device: torch.device,
        max_running_requests: int = 1,
        max_prefill_length: int = 1,
        max_pages_per_seq: int = 1,
        max_seq_len: int = 1,
        cuda_graph_max_bs: int = 0,
    ) -> None:
        self.model, self.pools, self.device = model, pools, device
        self.max_seq_len = max_seq_len
        # decode steps replay CUDA graphs on CUDA unless disabled (cuda_graph_max_bs 0)
        bs = min(cuda_graph_max_bs, max_running_requests)
        # NOTE: FT_DEBUG's checks read device values on the host, which a graph capture forbids
        self.graphs = DecodeGraphs(bs) if device.type == "cuda" and bs > 0 and not debug_checks() else None
        rows, tokens = max_running_requests, max(max_prefill_length, max_running_requests)
        i64, f32 = torch.int64, torch.float32
        self.buffers: dict[str, StagedBuffer] = {
            name: StagedBuffer(n, dtype, device) for name, n, dtype in (
                ("input_ids", tokens, i64), ("positions", tokens, i64),
                ("seq_lens", rows, i64), ("last_token_index", rows, i64), ("mamba_slots", rows, i64),
                ("slot_mapping", rows, i64),
                ("temperature", rows, f32), ("top_k", rows, i64), ("top_p", rows, f32), ("uniform", rows, f32),
            )
        }
        self.page_table = PageTableBuffer(rows, max_pages_per_seq, device)
        self.routing = None  # a `routing_override.TraceRouting` (synthetic traces): set by the engine
        self._sampled = torch.zeros(rows, dtype=i64, pin_memory=device.type == "cuda")  # host side of token ids
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self.last_logits: torch.Tensor | None = None  # [B, V] of the last step (tests and debugging)

    # ------------------------------------------------------------------------------- inputs
    def prepare(self, work: ScheduledWork) -> ForwardBatch:
        """The batch of `work` as views of the persistent buffers."""
        ids: list[int] = []
        pos: list[int] = []
        last, slots = [], []
        for seq, n in zip(work.seqs, work.num_tokens):
            start = seq.num_computed
            ids.extend(_tokens(seq, start, n))
            pos.extend(range(start, start + n))
            last.append(len(ids) - 1)
            slots.append(seq.mamba_slot)
        buf = self.buffers
        tables = self.page_table.load([seq.pages for seq in work.seqs])
        slices = [SeqSlice(seq.num_computed, n, table, seq.mamba_slot)
                  for seq, n, table in zip(work.seqs, work.num_tokens, tables)]
        batch = ForwardBatch(buf["input_ids"].load(ids), buf["positions"].load(pos), slices)
        # NOTE: these two are cached properties of ForwardBatch: set here, they are buffer views.
        batch.last_token_index = buf["last_token_index"].load(last)
        batch.mamba_slots = buf["mamba_slots"].load(slots)
        batch.forced_experts = self._forced([s.request_id for s in work.seqs], list(work.num_tokens))
        return batch

    def _forced(self, request_ids: list[str], counts: list[int], pad: int = 0) -> torch.Tensor | None:
        """The traced experts of the step's tokens, [T + pad, layers, k] in a persistent buffer
        (padding rows repeat the first token's); None without a trace."""
        r = self.routing
        if r is None:
            return None
        per_token = r.num_layers * r.top_k
        values = r.draw(request_ids, counts)
        values += values[:per_token] * pad
        buf = self.buffers.get("forced_experts")
        if buf is None:
            buf = self.buffers["forced_experts"] = StagedBuffer(self.buffers["input_ids"].capacity * per_token,
                                                                torch.int64, self.device)
        return buf.load(values).view(-1, r.num_layers, r.top_k)

    def sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        """The rows' sampling parameters in the buffers; step = tokens generated so far."""
        rows = [SamplingBatch.row(s.params, s.seed, len(s.output_ids)) for s in seqs]
        temp, top_k, top_p, uniform = (list(c) for c in zip(*rows))
        buf = self.buffers
        return SamplingBatch(
            buf["temperature"].load(temp), buf["top_k"].load(top_k), buf["top_p"].load(top_p),
            buf["uniform"].load(uniform), *SamplingBatch.flags([s.params for s in seqs]),
        )

    # ------------------------------------------------------------------------------- step
    def prepare_decode(self, seqs: list[Sequence], n: int) -> ForwardBatch:
        """A decode batch (one new token per sequence) padded to n rows with copies of the first
        sequence, every input in the persistent buffers, `decode` set: the forward then reads
        device tensors only (what a CUDA graph replays)."""
        real = len(seqs)
        rows = list(seqs) + [seqs[0]] * (n - real)
        page = self.pools.kv.page_size
        pos = [s.num_computed for s in rows]
        buf = self.buffers
        table = self.page_table.load_rows([s.pages for s in rows])
        slices = [SeqSlice(p, 1, table[i], s.mamba_slot) for i, (s, p) in enumerate(zip(rows, pos))]
        batch = ForwardBatch(buf["input_ids"].load([_tokens(s, p, 1)[0] for s, p in zip(rows, pos)]),
                             buf["positions"].load(pos), slices)
        # NOTE: padding rows read like the first sequence but write nowhere (slot -1): the fused
        # kernels update states in place, so two rows must never share a slot they write
        kv_slots = [s.pages[p // page] * page + p % page for s, p in zip(seqs, pos)]
        batch.decode = DecodeMeta(buf["slot_mapping"].load(kv_slots + [-1] * (n - real)), table,
                                  buf["seq_lens"].load([p + 1 for p in pos]), self.max_seq_len)
        batch.last_token_index = buf["last_token_index"].load(list(range(n)))
        batch.mamba_slots = buf["mamba_slots"].load([s.mamba_slot for s in seqs] + [-1] * (n - real))
        batch.forced_experts = self._forced([s.request_id for s in seqs], [1] * real, pad=n - real)
        return batch

    def run(self, work: ScheduledWork) -> list[int | None]:
        """One forward pass over `work`; for each sequence the sampled token, or None when its
        part was a chunk of a longer prompt (no token yet)."""
        experts = self.pools.experts
        if experts is not None:
            experts.collect()  # NOTE: the last offloaded decode step's landings, before anything reads the cache
        if not work.is_prefill and all(n == 1 for n in work.num_tokens):
            logits = self._decode(work.seqs)
            done = [True] * len(work.seqs)
        else:
            logits = self.model.forward(self.prepare(work), self.pools)  # [B, V] float32
            done = [seq.num_computed + n >= seq.num_tokens for seq, n in zip(work.seqs, work.num_tokens)]
        self._count_hits(sum(work.num_tokens))
        self.last_logits = logits
        if not any(done):  # chunks of longer prompts only
            self._wait()
            return [None] * len(done)
        sampled = sample(logits, self.sampling(work.seqs))
        if self.routing is not None:  # NOTE: while the device works: the next step's traced experts
            self.routing.prefetch([s.request_id for s, d in zip(work.seqs, done) if d])
        tokens = self._to_host(sampled)
        return [t if d else None for t, d in zip(tokens, done)]

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] of a decode step: a graph replay where one applies, else eager. Offloaded
        experts in read-through mode are bracketed by the cache's begin_step / end_step."""
        b = len(seqs)
        experts = self.pools.experts
        rt = experts.read_through if experts is not None else None
        if rt is not None:
            rt.begin_step(b, self.model.top_k)
        try:
            return self._decode_forward(seqs, b, experts, rt)
        finally:
            if rt is not None:
                rt.end_step()

    def _decode_forward(self, seqs: list[Sequence], b: int, experts, rt) -> torch.Tensor:
        n = self.graphs.bucket(b) if self.graphs is not None and not self.graphs.disabled else None
        capturable = experts is None or (runs_triton(experts.slots, self.device)
                                         and (experts.all_resident or rt is not None))
        if n is None or not capturable:
            # NOTE: offloaded experts without read-through are loaded by host-side bookkeeping, and the
            # reference MoE (dense slots) groups pairs on the host: neither can be captured
            return self.model.forward(self.prepare_decode(seqs, b), self.pools)
        batch = self.prepare_decode(seqs, n)
        # NOTE: the decode step reads the pools through Triton kernels only (pointers and strides, no
        # bound baked in), so a graph stays valid while the addresses stay: a VMM rebuild keeps them
        pools = self.pools.kv.tensors + self.pools.mamba.tensors
        if experts is not None:
            pools = pools + experts.tensors + [experts.slot_table]
            if rt is not None:
                pools = pools + list(rt.book) + [t for t in experts.host if t is not None]
        key = (*(t.data_ptr() for t in pools), self.page_table.table.data_ptr(),
               *(buf.device_buffer.data_ptr() for buf in self.buffers.values()))
        return self.graphs.run(n, key, lambda: self.model.forward(batch, self.pools))[:b]

    def _count_hits(self, tokens: int) -> None:
        """Resident experts: every (token, expert) pair is a hit (the MoE layer does not count
        them, since a replayed graph runs no Python)."""
        experts = self.pools.experts
        if experts is not None and experts.all_resident:
            experts.stats.hits += tokens * self.model.moe_pairs_per_token

    def _to_host(self, ids: torch.Tensor) -> list[int]:
        """[B] int64 on the device -> Python ints: one small copy (pinned, then an event wait)."""
        if self._event is None:
            return ids.tolist()
        b = ids.shape[0]
        if b > self._sampled.numel():  # NOTE: grows only for a batch over the constructor's size
            self._sampled = torch.zeros(b, dtype=torch.int64, pin_memory=True)
        out = self._sampled[:b]
        out.copy_(ids, non_blocking=True)
        self._wait()
        return out.tolist()

    def _wait(self) -> None:
        """Wait for this step's device work. NOTE: every step ends here, so the next step may
        rewrite the host staging that this step's non-blocking copies read."""
        if self._event is not None:
            self._event.record()
            self._event.synchronize()


def _tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start+n] without building the whole list."""
    p = len(seq.prompt_ids)
    out = seq.prompt_ids[start : start + n] if start < p else []
    if start + n > p:
        out += seq.output_ids[max(0, start - p) : start + n - p]
    return out
