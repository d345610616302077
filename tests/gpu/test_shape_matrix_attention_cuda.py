"""The attention kernels on the GPU over the shapes a Qwen3-Next-family checkpoint may bring (issue 37),
each against its torch reference in fp32 on the device: the decode step (`write_kv_decode`, then
paged decode attention, ungated and gated, through the dispatcher's split rule and the other path:
single pass or split-K) over bf16 / fp16 / fp32 and NVFP4 caches, and the Triton prefill over
packed sequences (varlen: several sequences, each a chunk after its cached prefix, pages of all
of them interleaved in one pool) over bf16 / fp32 and NVFP4 caches.
tests/gpu/test_attention_cuda.py keeps the flagship's shapes (16 q / 2 kv heads, D 256).

The matrix is a covering subset, not the Cartesian product: every distinct combination of a
kernel's constexprs (head dim, group size, page size, dtype, cache format, gate, path) and of
Triton's integer specializations (a value of 1, a multiple of 16, any other) is a compile of
1-3 s, so a case stands for one such combination and carries many shapes in its data:

* Lengths: a decode batch holds every boundary length at once (1, 63, 64, 65, 127, 128, 129,
  4095, 4096, 4097: the 32/64-key blocks, the 8-128-token query tiles and their neighbours)
  and a padding row (length 0, as a CUDA graph's padded batch has); the split rule's path and
  the other one both run over it, so split-K also meets splits that hold no token.
* Prefill: one `SWEEP` case per head dim packs ten chunks, every boundary length once, at starts
  0, on a page / tile boundary, and off both (so each boundary length meets each head dim); it
  costs four compiles (T == 1, T and start multiples of 16, T not and start a multiple of 16,
  neither). The other cases pack `PACK` (four chunks after unaligned prefixes, one compile).
* Each of the other dimensions takes every value at least once per kernel: head dims 64, 128,
  256; groups (Hq / Hkv) 1, 2, 4, 8, 12; pages of 16, 64 and 128 tokens (64 is the engine's
  default); few heads (4 / 4) and many (64 / 32, 64 / 16); one kv head (a tensor-parallel
  rank's share of 2); bf16, fp32 (and fp16 for decode) activations; NVFP4 at every head dim.
  The risky pairs are together: the smallest head dim with the largest group (D 64, 24 / 2,
  plain and NVFP4), 24 q heads over 2 kv heads (the seeds' model) at D 256, many heads at D 64.

Checks: fresh random inputs; outputs filled with NaN before each call (`out=` for decode; the
prefill launcher, which allocates its output, gets NaN from `torch.empty_like`), the split-K
workspace too; the pool is NaN wherever no token of a sequence is, and page-table entries past
a sequence's pages point at NaN pages, so a missed write or a read outside a sequence fails.
Each sequence is compared on its own by relative RMS (`rel_rms`, NaN never passes) with the
tolerance of its activation dtype; the decode write bit for bit against the reference's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

import ft.kernels.attention.kernel as decode_kernels
import ft.kernels.attention.prefill_kernel as prefill_kernels
from ft.kernels.attention import (
    decode_attention_workspace,
    paged_attention,
    paged_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    write_kv_decode,
    write_kv_decode_ref,
)
from ft.kernels.attention.decode_tuning import decode_split_count
from ft.kernels.attention.kernel import paged_decode_attention_triton
from ft.kernels.attention.reference import NVFP4_CACHE, quantize_kv
from ft.kernels.options import kernel_options

pytestmark = pytest.mark.gpu

DEV = "cuda"
LAYERS = 2  # the caches are views of layer 1 of a two-layer pool (not contiguous), as the engine's
ACT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

TOL_FP32 = 1e-5
"""Relative RMS for fp32 activations (an NVFP4 cache too: its tiles are exact in fp32): the reference's
arithmetic up to the order of the sums and the GPU's approximate exp2 and division (a few ulps)."""
TOL_BF16 = 5e-3
"""Relative RMS for bf16 activations: the kernels round the probabilities to bf16 (fp16 over an NVFP4
cache) before the p.V dot, and the output to bf16 once; those two roundings emulated in torch give up
to 2.4e-3 (12 heads, D 128, 1 to 16K keys, with and without the gate): twice that."""
TOL_FP16 = 1e-3
"""Relative RMS for fp16 activations: the same two roundings at fp16's precision, 3e-4 emulated."""
TOL = {torch.float32: TOL_FP32, torch.bfloat16: TOL_BF16, torch.float16: TOL_FP16}

NVFP4_SCALE = (0.004, 0.005)
"""The layer's (K, V) scales of the NVFP4 caches: randn K/V (|x| < ~6) get block scales amax / (6 s) of
~200-250, inside e4m3's 448; K's and V's differ, so a kernel that takes one for the other fails."""

LENGTHS = (1, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097)
"""Boundary lengths: one token, and each side of 64, 128 and 4096 (the kernels' 32/64-key blocks,
the prefill's 8-128-token query tiles, a long context's block and page counts)."""
DECODE_LENS = (4097, 0, *LENGTHS[:-1])
"""A decode batch: every boundary length and a padding row (length 0: zeros, and no KV write)."""
SWEEP = ((0, 4097), (64, 4096), (0, 128), (128, 64), (4096, 63), (37, 65), (129, 127), (4097, 129), (3, 4095),
         (200, 1))
"""Prefill chunks (start, T) packed in one batch: every boundary length once, at start 0, on page and
tile boundaries, and off them. Their (T, start) fall in four of Triton's integer specializations."""
PACK = ((5, 63), (70, 129), (1000, 127), (133, 4097))
"""Prefill chunks (start, T) after unaligned prefixes, all in one integer specialization (one compile)."""


@dataclass(frozen=True)
class DecodeCase:
    d: int
    hq: int
    hkv: int
    page: int
    act: str  # ACT's key: the activations' dtype, and the cache's unless kv is "nvfp4"
    kv: str  # "plain" (the activations' dtype) | "nvfp4"
    gated: bool
    lens: tuple[int, ...] = DECODE_LENS

    @property
    def id(self) -> str:
        return (f"{shape_id(self.d, self.hq, self.hkv, self.page, self.act, self.kv)}{'-gate' if self.gated else ''}"
                f"-T{min(self.lens)}-{max(self.lens)}x{len(self.lens)}")


@dataclass(frozen=True)
class PrefillCase:
    d: int
    hq: int
    hkv: int
    page: int
    act: str
    kv: str
    chunks: tuple[tuple[int, int], ...]  # (start, T) of each packed sequence

    @property
    def id(self) -> str:
        ts = [t for _, t in self.chunks]
        return f"{shape_id(self.d, self.hq, self.hkv, self.page, self.act, self.kv)}-T{min(ts)}-{max(ts)}x{len(ts)}"


def shape_id(d: int, hq: int, hkv: int, page: int, act: str, kv: str) -> str:
    return f"D{d}-Hq{hq}-Hkv{hkv}-page{page}-{'nvfp4kv-' if kv == 'nvfp4' else ''}{act}"


DECODE_CASES = [
    DecodeCase(64, 24, 2, 64, "bf16", "plain", True),  # the smallest head dim with the largest group
    DecodeCase(128, 8, 1, 16, "bf16", "plain", False),  # one kv head
    DecodeCase(256, 24, 2, 64, "bf16", "plain", True),  # the seeds' model
    DecodeCase(256, 4, 4, 128, "fp32", "plain", False),  # few heads, no grouping
    DecodeCase(128, 8, 2, 64, "fp16", "plain", True),
    DecodeCase(64, 64, 32, 16, "fp32", "plain", True),  # many heads: the split rule runs single-pass
    DecodeCase(256, 24, 2, 64, "bf16", "nvfp4", True),
    DecodeCase(64, 24, 2, 16, "bf16", "nvfp4", False),
    DecodeCase(128, 8, 8, 128, "fp32", "nvfp4", True),  # fp32 queries: the exact halves loop
]

PREFILL_CASES = [
    PrefillCase(64, 24, 2, 64, "bf16", "plain", SWEEP),  # the smallest head dim with the largest group
    PrefillCase(128, 32, 4, 16, "bf16", "plain", SWEEP),
    PrefillCase(256, 24, 2, 64, "bf16", "plain", SWEEP),  # the seeds' model
    PrefillCase(256, 4, 4, 128, "fp32", "plain", PACK),  # few heads, no grouping: 128-token query tiles
    PrefillCase(128, 8, 4, 64, "fp32", "plain", PACK),
    PrefillCase(64, 64, 16, 16, "fp32", "plain", PACK),  # many heads
    PrefillCase(128, 8, 1, 128, "bf16", "plain", PACK),  # one kv head
    PrefillCase(256, 24, 2, 64, "bf16", "nvfp4", PACK),
    PrefillCase(64, 24, 2, 16, "fp32", "nvfp4", PACK),
    PrefillCase(128, 8, 2, 128, "bf16", "nvfp4", PACK),
]


@pytest.fixture(autouse=True)
def _fp32_references(monkeypatch):
    """The references' fp32 matmuls in full fp32, whatever an earlier test set (TF32 would miss TOL_FP32)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32; NaN anywhere in `out` gives NaN, which fails every `err < tol`."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def spy(monkeypatch, module, name: str) -> list:
    """Record the calls of module.name (the dispatchers import their kernels at call time: they see this)."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


_EMPTY_LIKE = torch.empty_like


def _nan_empty_like(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    out = _EMPTY_LIKE(x, *args, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out


@contextlib.contextmanager
def nan_outputs():
    """Within: `torch.empty_like` gives float tensors filled with NaN, so that an output a launcher
    allocates itself (the prefill's takes no `out=`) shows every element the kernel does not write."""
    with mock.patch.object(torch, "empty_like", _nan_empty_like):
        yield


def make_pool(capacity: list[int], filled: list[int], hkv: int, d: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 pool [P, LAYERS, 2, page, Hkv, D], NaN but for random K/V at positions 0 .. filled[i]-1 of
    each sequence i, whose ceil(capacity[i] / page) pages are shuffled among the others'; page-table
    entries past them point at spare NaN pages, page 0 among them (a masked load that falls back to
    page 0 reads NaN) -> (pool, page_table [B, max pages + 1] int64)."""
    need = [-(-c // page) for c in capacity]
    total, spare = sum(need), 3
    perm = torch.randperm(total + spare - 1, device=DEV) + 1
    spares = torch.cat([torch.zeros(1, dtype=perm.dtype, device=DEV), perm[total:]])
    kv = torch.full((total + spare, LAYERS, 2, page, hkv, d), float("nan"), device=DEV)
    table = spares[torch.randint(spare, (len(capacity), max(need) + 1), device=DEV)]
    first = 0
    for i, (k, n) in enumerate(zip(need, filled)):
        table[i, :k] = perm[first:first + k]
        first += k
        pos = torch.arange(n, device=DEV)
        kv[table[i, pos // page], :, :, pos % page] = torch.randn(n, LAYERS, 2, hkv, d, device=DEV)
    return kv, table


def as_cache(kv: torch.Tensor, act: torch.dtype, kv_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 pool as the engine holds it -> (pool in act's dtype, None), or the NVFP4 pool (uint8
    [P, LAYERS, 2, page, Hkv, D/2 + D/16]; NaN rows get NaN block scales: their reads give NaN) and
    its float32 [2] scales."""
    if kv_format != "nvfp4":
        return kv.to(act), None
    scale = torch.tensor(NVFP4_SCALE, device=DEV)
    return torch.stack([quantize_kv(kv[:, :, i], scale[i], NVFP4_CACHE) for i in (0, 1)], dim=2), scale


def layer_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's K and V caches: [P, page, Hkv, R] views of the pool."""
    return kv[:, 1, 0], kv[:, 1, 1]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_decode_step_shape_matrix(case: DecodeCase, monkeypatch):
    """One decode step as the model runs it: `write_kv_decode` stores each sequence's new token (at
    position len - 1; a padding row writes nothing), bit for bit the reference's store; then
    `paged_decode_attention` (the split count the dispatcher picks from the declared longest
    context) and the Triton launcher on the other path (single pass where the rule splits, else
    5 splits), each sequence against the fp32 reference, padding rows exactly zero."""
    torch.manual_seed(0)
    act, b, page = ACT[case.act], len(case.lens), case.page
    kv32, table = make_pool(list(case.lens), [max(n - 1, 0) for n in case.lens], case.hkv, case.d, page)
    kv, kv_scale = as_cache(kv32, act, case.kv)
    del kv32
    k_cache, v_cache = layer_views(kv)
    lens = torch.tensor(case.lens, dtype=torch.int32, device=DEV)

    k_new, v_new = (torch.randn(b, case.hkv, case.d, device=DEV, dtype=act) for _ in range(2))
    last = (lens.long() - 1).clamp(min=0)
    slots = table.gather(1, (last // page)[:, None])[:, 0] * page + last % page
    slots = torch.where(lens > 0, slots, -1)
    expected = kv.clone()
    write_kv_decode_ref(*layer_views(expected), k_new, v_new, slots, kv_scale)
    writes = spy(monkeypatch, decode_kernels, "write_kv_decode_triton")
    write_kv_decode(k_cache, v_cache, k_new, v_new, slots, kv_scale)
    assert writes, "write_kv_decode did not run the Triton kernel"
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"write_kv_decode: {m}")
    del expected

    qg = torch.randn(b, case.hq, 2 * case.d, device=DEV, dtype=act)  # q and gate as the model slices its projection
    q, gate = qg[..., :case.d], (qg[..., case.d:] if case.gated else None)
    scale = case.d ** -0.5
    ref = paged_decode_attention_ref(q.float(), k_cache, v_cache, table, lens, scale,
                                     gate=None if gate is None else gate.float(), kv_scale=kv_scale)
    longest = max(case.lens)
    opts = kernel_options().decode_attention
    prmt = case.kv == "nvfp4" and act != torch.float32 and opts.nvfp4_prmt  # (every D here is a multiple of 64)
    rule = decode_split_count(b, case.hkv, longest, torch.device(DEV), prmt)
    ws = decode_attention_workspace(b, case.hq, case.d, max(opts.max_splits, opts.prmt_max_splits), DEV)
    attends = spy(monkeypatch, decode_kernels, "paged_decode_attention_triton")
    for path in ("rule", "other"):
        ws.acc.fill_(float("nan"))
        ws.stats.fill_(float("nan"))
        out = torch.full((b, case.hq, case.d), float("nan"), device=DEV, dtype=act)
        if path == "rule":
            y = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_seq_len=longest, workspace=ws,
                                       out=out, gate=gate, kv_scale=kv_scale)
            assert attends, "paged_decode_attention did not run the Triton kernels"
            splits = rule
        else:
            splits = 1 if rule > 1 else 5
            y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale, splits=splits, workspace=ws,
                                              out=out, gate=gate, kv_scale=kv_scale)
        assert y.data_ptr() == out.data_ptr()
        errors = {n: rel_rms(y[i], ref[i]) for i, n in enumerate(case.lens) if n}
        bad = {n: e for n, e in errors.items() if not e < TOL[act]}
        assert not bad, f"{path} path ({splits} splits): rel RMS over {TOL[act]} at lengths {bad}"
        for i, n in enumerate(case.lens):
            if n == 0:
                assert torch.equal(y[i], torch.zeros_like(y[i])), f"{path} path: a padding row is not zeros"


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c.id for c in PREFILL_CASES])
def test_prefill_shape_matrix(case: PrefillCase, monkeypatch):
    """Packed prefill as the model runs it (`paged_attention` per sequence over a view of the packed
    q, a strided half of the q projection): every sequence's chunk on the Triton kernel, each
    against the fp32 reference."""
    torch.manual_seed(0)
    act = ACT[case.act]
    n_ctx = [s + t for s, t in case.chunks]
    kv32, table = make_pool(n_ctx, n_ctx, case.hkv, case.d, case.page)
    kv, kv_scale = as_cache(kv32, act, case.kv)
    del kv32
    k_cache, v_cache = layer_views(kv)
    ts = [t for _, t in case.chunks]
    q = torch.randn(sum(ts), case.hq, 2 * case.d, device=DEV, dtype=act)[..., :case.d]
    offsets = [sum(ts[:i]) for i in range(len(ts))]
    scale = case.d ** -0.5
    calls = spy(monkeypatch, prefill_kernels, "paged_prefill_attention_triton")
    with nan_outputs():
        outs = [paged_attention(q[o:o + t], k_cache, v_cache, table[i], s, scale, kv_scale)
                for i, ((s, t), o) in enumerate(zip(case.chunks, offsets))]
    assert len(calls) == len(case.chunks), "paged_attention did not run the Triton kernel for every chunk"
    bad = {}
    for i, ((s, t), o) in enumerate(zip(case.chunks, offsets)):
        ref = paged_attention_ref(q[o:o + t].float(), k_cache, v_cache, table[i], s, scale, kv_scale)
        err = rel_rms(outs[i], ref)
        if not err < TOL[act]:
            bad[f"start {s} T {t}"] = err
        del ref
    assert not bad, f"rel RMS over {TOL[act]}: {bad}"


def test_head_dim_over_256_refused():
    """A checkpoint with heads of 512 (over the kernels' MAX_HEAD_DIM of 256): both dispatchers refuse it
    with a ValueError naming the shapes, before any launch, rather than fall back or compute garbage."""
    d, page = 512, 16
    q = torch.randn(3, 2, d, device=DEV, dtype=torch.bfloat16)
    k_cache = torch.randn(4, page, 1, d, device=DEV, dtype=torch.bfloat16)
    table = torch.arange(4, device=DEV)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(q, k_cache, k_cache, table, 5, d ** -0.5)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q, k_cache, k_cache, table[None].expand(3, 4),
                               torch.tensor([1, 9, 30], dtype=torch.int32, device=DEV), d ** -0.5)
