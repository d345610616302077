"""Streamed expert prefill: a long chunk's missing experts cross PCIe once, layer by layer, into
staging pages, without touching the expert cache.

A prefill chunk of a few hundred tokens or more routes to (nearly) every expert of every MoE layer,
so on a card too small for the experts, what the cache lacks must cross the bus once per chunk.
Landing those experts in the cache (its `ensure`, one copy per expert and tensor, a host sync per
layer) would evict what decode uses and serialize the copies with the compute. Here instead:

* The plan needs no routing: for MoE layer L, every expert the cache lacks is staged (the host
  twin of the slot table says which), page by page into a ring of `pages` staging pages of
  `page_experts` slots each, on a copy stream. So the copies of layer L + 1 may be queued, and run,
  while layer L computes; the host never waits for the device. How a page is filled is a variant
  chosen by name (`LOADERS`): `copy` issues one copy per run of consecutive ids and tensor on the
  copy engines (no SM taken from the compute, but ~15 us of host time a call: with half the experts
  resident the runs are ~1 expert long, ~22,000 calls for a chunk of the 80B, which bound it);
  `gather` launches one kernel per tensor that reads the page's experts from the pinned store in
  place (`ft.kernels.host_gather.copy_rows`, ids uploaded with the plan: 5 launches a page, a few
  SMs busy beside the compute); `auto` (the default) takes `copy` for a page whose calls the host
  issues in under half the page's time on the bus (`copy_keeps_up`: few, long runs, as on a card
  that caches few experts) and `gather` otherwise. Measured on the H200 (bench/RESULTS.md,
  2026-12-03): on a 32 GiB card (half the experts resident, scattered pages) gather is 13-35%
  faster than copy for 1K-8K prompts; on a 16 GiB card (long runs) copy beats gather and `auto`,
  mixing them, beats both.
* The chunk's pairs are computed in passes (`ft.kernels.moe.moe_over_pools`): one over the
  resident experts in the cache's slots, then one per staged page, each waiting (on the device)
  for its page's copies; a page is refilled only after the pass that read it (events).
* Nothing lands in the cache (the admission rule "land none"): the experts decode keeps hot stay
  resident, and the decode right after a long prompt runs at the speed it ran before it. The
  cache's hit and miss counts are not touched either (they describe decode); what was streamed is
  counted here (`StreamStats`).

On a CPU device the copies are plain copies (no streams); the plan and the passes are the same.
Contract: the cache's read-through (if any) was collected before the forward (the model runner
does that at each step's start), so the host twin of the slot table is the device's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ft.kernels.host_gather import copy_rows
from ft.kernels.moe import SlotWeights

PAGES = 3
"""Staging pages in the ring: one being read by a pass, one being filled, one queued ahead."""
LOADERS = ("auto", "gather", "copy")
"""How a staging page is filled (see the module's docstring)."""
COPY_CALL_S = 15e-6
"""Host seconds one copy call costs (H200 host, torch 2.11: ~22,650 calls in ~0.34 s, session 24's profile)."""
HOST_LINK_BYTES_S = 50e9
"""The host link's bytes per second that a page's copies drain at (PCIe 5 x16, measured 48-55 GB/s)."""
COPY_STREAM_PRIORITY = -1
"""The copy stream's priority (torch: lower is higher; -1 the highest a CUDA device offers by default)."""
STREAM_PAGE_EXPERTS = 64
"""Experts per staging page by default (fewer when a layer has fewer): a pass's grouped GEMMs over
64 experts' pairs still fill the device; not yet tuned on the device."""


@dataclass
class StreamStats:
    chunks: int = 0  # MoE layer calls that streamed (one per layer per long chunk)
    experts: int = 0  # experts copied into staging
    bytes: int = 0  # bytes copied from the host store
    copies: int = 0  # host calls that filled pages (kernel launches or copies: per page x tensor, or per run x tensor)


class PrefillStream:
    """Staging pages over an `ExpertCache`'s host store, and the passes of one MoE layer's chunk.

    cache: the `ExpertCache` (its host store [L, E, ...], slots, and host twin `table_np`);
    page_experts: slots per page; pages: pages in the ring; min_tokens: chunks of at least this many
    tokens stream (`wants`), shorter ones take the cache's own path (`ensure`); loader: one of `LOADERS`
    (may be changed between chunks: benchmarks compare them on one engine).
    """

    def __init__(self, cache, page_experts: int, pages: int = PAGES, min_tokens: int = 1, loader: str = "auto") -> None:
        if page_experts < 1 or pages < 1:
            raise ValueError(f"staging needs at least one page of one expert, got {pages} x {page_experts}")
        if loader not in LOADERS:
            raise ValueError(f"prefill stream: loader must be one of {LOADERS}, got {loader!r}")
        self.loader = loader
        self.cache = cache
        self.page_experts, self.pages, self.min_tokens = page_experts, pages, min_tokens
        device = cache.slot_table.device
        n = page_experts * pages
        self.staging = SlotWeights(*(None if t is None else torch.empty((n, *t.shape[2:]), dtype=t.dtype, device=device)
                                     for t in cache.host))
        self.device = device
        cuda = device.type == "cuda"
        # high priority, so a gather's programs may take SMs as the compute's free up (against a normal
        # priority: no difference measured, bench/RESULTS.md; kept as the safer order)
        self.copy_stream = torch.cuda.Stream(device, priority=COPY_STREAM_PRIORITY) if cuda else None
        self.gather_options = None  # the gather loader's `CopyRowsOptions` (None: the kernel's default)
        self.loaded = [torch.cuda.Event() for _ in range(pages)] if cuda else None
        self.freed: list = [None] * pages  # the event after the last pass that read each page (None: unused)
        self.ring = 0  # the next page to fill
        self.expert_bytes = self.bytes_for(cache.host, 1, 1)  # one expert's bytes in every tensor
        self.stats = StreamStats()

    @staticmethod
    def bytes_for(host: SlotWeights, page_experts: int, pages: int = PAGES) -> int:
        """Device bytes of the staging pages for a host store [L, E, ...] (what the budget reserves)."""
        per_expert = sum(t[0, 0].numel() * t.element_size() for t in host if t is not None)
        return per_expert * page_experts * pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.staging if t is not None)

    def wants(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` tokens streams (the cache is not all resident: the caller checks)."""
        return tokens >= self.min_tokens

    def passes(self, layer: int, ids: torch.Tensor):
        """The passes of MoE layer `layer` for routed expert ids [T, k] (a generator for
        `moe_over_pools`): (slots of the resident experts, the cache's pool), then per staged page
        (slots in the staging pool, -1 elsewhere, the staging pool), its copies queued just before.
        Between two draws the caller queues the pass's kernels on the current stream."""
        cache = self.cache
        row = cache.table_np[layer]
        missing = np.flatnonzero(row < 0)
        groups = [missing[i : i + self.page_experts] for i in range(0, missing.size, self.page_experts)]
        # one upload per layer: row 0 the resident experts' slots, row 1 + q page q's staging slots
        # (both -1 elsewhere); slots assigned on the host, so the passes follow the copies exactly
        # and the pages' expert ids after it ([pages, page_experts], the gather loader's rows)
        g, e, pe = len(groups), row.size, self.page_experts
        flat = np.full((1 + g) * e + g * pe, -1, dtype=np.int32)
        plan = flat[: (1 + g) * e].reshape(1 + g, e)
        page_ids = flat[(1 + g) * e :].reshape(g, pe)
        plan[0] = np.where(row >= 0, row, -1)
        pages = []
        for q, group in enumerate(groups):
            page = (self.ring + q) % self.pages
            plan[1 + q, group] = page * pe + np.arange(group.size, dtype=np.int32)
            page_ids[q, : group.size] = group
            pages.append(page)
        flat_dev = torch.from_numpy(flat)
        uploaded = None
        if self.device.type == "cuda":
            flat_dev = flat_dev.pin_memory().to(self.device, non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(torch.cuda.current_stream(self.device))
        plan_dev = flat_dev[: (1 + g) * e].view(1 + g, e)
        ids_dev = flat_dev[(1 + g) * e :].view(g, pe)
        ids = ids.long()
        yield plan_dev[0][ids], cache.slots
        self.stats.chunks += 1
        for q, (group, page) in enumerate(zip(groups, pages)):
            self.ring = (page + 1) % self.pages
            self._load(layer, group, ids_dev[q, : group.size], page, uploaded)
            uploaded = None  # the copy stream has waited once for this layer's upload
            yield plan_dev[1 + q][ids], self.staging
            if self.device.type == "cuda":  # the pass's kernels are queued: the page is free after them
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self.freed[page] = ev
        # NOTE: flat_dev is freed (to the compute stream's pool) when this generator ends; the copy
        # stream's last read of it ran before the last pass, which waited for that page's copies

    def copy_keeps_up(self, runs: int, experts: int) -> bool:
        """Whether a page of `experts` experts in `runs` runs of consecutive ids is filled by copies
        (the `auto` loader's rule): the host issues its runs x tensors calls (`COPY_CALL_S` each) in at
        most half the time the bus takes for its bytes (`HOST_LINK_BYTES_S`), so the copy engines,
        which take no SM from the compute, stay fed. 64 experts of the 80B: at most 15 runs."""
        tensors = sum(t is not None for t in self.staging)
        return runs * tensors * COPY_CALL_S <= 0.5 * experts * self.expert_bytes / HOST_LINK_BYTES_S

    def _load(self, layer: int, experts: np.ndarray, experts_dev: torch.Tensor, page: int, uploaded) -> None:
        """Fill `page`'s first slots with `experts` (sorted ids; `experts_dev` the same on the device)
        of `layer` from the host store, by the loader; on CUDA on the copy stream, after the last pass
        that read the page (and after the plan's upload, event `uploaded`, when given), and the
        current stream waits for them."""
        base = page * self.page_experts
        cuda = self.copy_stream is not None
        if cuda:
            if self.freed[page] is not None:
                self.copy_stream.wait_event(self.freed[page])
            if uploaded is not None:
                self.copy_stream.wait_event(uploaded)
            ctx = torch.cuda.stream(self.copy_stream)
        else:
            ctx = nullcontext()
        pairs = [(dst, src[layer]) for dst, src in zip(self.staging, self.cache.host) if dst is not None]
        with ctx:
            runs = list(_runs(experts)) if self.loader != "gather" else None
            if self.loader == "gather" or (self.loader == "auto" and not self.copy_keeps_up(len(runs), experts.size)):
                n = int(experts.size)
                for dst, src in pairs:
                    copy_rows(dst[base : base + n], src, experts_dev, self.gather_options)
                self.stats.copies += len(pairs)
            else:
                for a, b, at in runs:  # NOTE: the host's work per copy is what bounds a chunk: keep it bare
                    for dst, src in pairs:
                        dst[base + at : base + at + b - a].copy_(src[a:b], non_blocking=cuda)
                    self.stats.copies += len(pairs)
            if cuda:
                self.loaded[page].record(self.copy_stream)
        if cuda:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[page])
        self.stats.experts += int(experts.size)
        self.stats.bytes += int(experts.size) * self.expert_bytes


def _runs(experts: np.ndarray):
    """(first id, end id, offset in `experts`) of each run of consecutive ids in sorted `experts`."""
    if not experts.size:
        return
    breaks = np.flatnonzero(np.diff(experts) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [experts.size]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield int(experts[s]), int(experts[e - 1]) + 1, s

