"""Shape matrix of the MoE-side Triton kernels (issue 37): the routed MoE over expert slots
(`ft.kernels.moe`: per-pair decode path and grouped prefill path, NVFP4 slots; dense bf16 slots
take the torch reference), the decode MoE block with the shared expert (fused next norm, host
store and landing store), the router (`ft.kernels.router`), the expert lookup and commit
(`ft.kernels.expert_lookup`) and the NVFP4 linear at the experts' projection shapes
(`ft.kernels.nvfp4`: GEMV, ``tl.dot`` tiles, decode pass + cuBLAS), each against its torch
reference computed in fp32 on the same device.

How the subset was picked (not the Cartesian product: every distinct constexpr set is a compile):

* Every value of every dimension appears at least once: hidden {128, 1024, 2048, 2560, 4096},
  expert width {64, 256, 512, 640, 768}, experts {8, 64, 512}, top-k {1, 2, 8, 10}, tokens {1, 2,
  8, 63, 64, 65} plus the path edges (128 / 129: per-pair / grouped MoE; 2,048 / 2,049: the short /
  long grouped tile; 4,097: two grouped passes, the second of one token; 1,023 / 1,024: Triton /
  decode pass + cuBLAS), activations bf16 and fp32, weights NVFP4 and bf16.
* Risky pairs together: hidden 128 with width 64 (the smallest tiles; K below a block); the seeds'
  model (hidden 2560, width 640, 512 experts, top-10) on every kernel, since 2560 / 8 and 640 / 8
  words are not powers of two (two whole-K tiles in the decode MoE, `whole_k_pieces`: 256 + 64 and
  64 + 16; the K loops and masked K steps elsewhere); 4096 with 768 at 512
  experts (the largest pool, 2.7 GB in NVFP4); top-1 and top-10 on every kernel family; the
  grouped path with runs of pairs per slot at BLOCK_M - 1, BLOCK_M, BLOCK_M + 1 for both tiles.
* The rest fill in the per-kernel shape flags (t = 1 vs more configs, whole-K vs K loop, EVEN_K,
  HALVES, SWAP_AB) once each. bf16 weights exist only as dense slot pools, where the dispatchers
  run the references (`runs_triton` is False): those cases check that fallback. Shapes a launcher
  refuses (the host store where a row is not one or two whole-K tiles, more than DECODE_MAX_TOKENS
  decode tokens) are
  checked to raise ValueError.
* fp32 activations take the short grouped tile only (in fp32 the long tile spills and compiles for
  ~20 s). In all, about 70 distinct kernel configurations (sm_90 compiles of them: ~50 s on 2 cores).

Run on the device machine: ``python -m pytest -q tests/gpu/test_shape_matrix_moe_cuda.py``.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import pytest
import torch

from ft.kernels.expert_lookup import commit_landed_ref, expert_lookup_ref, new_book
from ft.kernels.expert_lookup.kernel import (commit_landed_triton, expert_lookup_owned_triton, expert_lookup_triton,
                                             route_lookup_owned_triton)
from ft.kernels.moe import (
    DECODE_MAX_TOKENS, SlotWeights, moe_decode, moe_decode_ref, moe_over_slots, moe_over_slots_ref, runs_triton,
)
from ft.kernels.moe.decode_kernel import moe_decode_triton
from ft.kernels.moe.grouped_kernel import GROUPED_CONFIG, GROUPED_CONFIG_SHORT
from ft.kernels.moe.kernel import moe_over_slots_triton
from ft.kernels.norm.reference import add_rms_norm_ref
from ft.kernels.nvfp4 import DEQUANT_MM_MIN_M, dequantize_nvfp4, nvfp4_linear, nvfp4_linear_ref
from ft.kernels.nvfp4.dequant_kernel import dequantize_nvfp4_triton, nvfp4_linear_dequant_mm
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.kernels.router import route, route_ref, router_topk
from ft.kernels.router.kernel import route_triton, router_topk_triton

pytestmark = pytest.mark.gpu

DEV = os.environ.get("FT_SHAPE_MATRIX_DEVICE", "cuda")
"""The device; only a throwaway CPU-interpreter check of this file's logic sets the variable."""
BF16, FP32 = torch.bfloat16, torch.float32
NAMES = {BF16: "bf16", FP32: "fp32", torch.float16: "fp16"}

TOL_FP32 = 1e-5
"""Relative RMS, fp32 activations: the kernels sum in fp32 like the reference, in another order."""
TOL_BF16 = 6e-3
"""Relative RMS, bf16 activations against the fp32 reference: one rounding to bf16 is ~1.6e-3;
the grouped MoE rounds three times (h, each pair's output, the sum), ~3e-3; twice that."""
TOL_BF16_REF = 1.2e-2
"""Relative RMS of the torch reference in bf16 (dense slot pools) against fp32: it rounds every
projection's output, the SiLU product and each pair's output to bf16 (~6 roundings, ~4e-3)."""
SKIP = 0.1
"""Fraction of routed pairs given slot -1 (computed in another call: offload groups) where T > 1."""


def tol(dtype: torch.dtype) -> float:
    return TOL_FP32 if dtype == FP32 else TOL_BF16


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; fails on NaN in `out` (an unwritten element of a poisoned output)."""
    assert not out.isnan().any(), "NaN in the output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def seed(case) -> None:
    """Fresh random inputs for each case, the same from run to run."""
    torch.manual_seed(zlib.crc32(str(case).encode()))


def nan_like(x: torch.Tensor, shape: tuple | None = None) -> torch.Tensor:
    return torch.full(shape or x.shape, float("nan"), dtype=x.dtype, device=x.device)


def nvfp4_weight(n: int, k: int, lead: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Random NVFP4 [..., N, K]: any byte (every nibble valid), block scales 2**U(-3, 3) in E4M3."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = torch.exp2(torch.empty(*lead, n, k // 16, device=DEV).uniform_(-3, 3)).to(torch.float8_e4m3fn)
    return packed, scale


def global_scale(fan_in: int, *shape: int) -> torch.Tensor:
    """Global scales ~ U(0.5, 1.5) / (8 sqrt(fan_in)): the weights' RMS (code 2.9 x block scale 2.8)
    near 1 / sqrt(fan_in), so that activations stay O(1) through the MoE."""
    return torch.empty(shape, device=DEV).uniform_(0.5, 1.5) / (8 * fan_in**0.5)


def nvfp4_pool(e: int, h: int, i: int) -> SlotWeights:
    w13, s13 = nvfp4_weight(2 * i, h, (e,))
    w2, s2w = nvfp4_weight(h, i, (e,))
    s2 = torch.cat([global_scale(h, e, 2), global_scale(i, e, 1)], dim=1)  # gate, up, down
    return SlotWeights(w13, w2, s13, s2w, s2)


def dense_pool(e: int, h: int, i: int) -> SlotWeights:
    return SlotWeights((torch.randn(e, 2 * i, h, device=DEV) / h**0.5).to(BF16),
                       (torch.randn(e, h, i, device=DEV) / i**0.5).to(BF16))


def routing(t: int, k: int, e: int, dtype: torch.dtype, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct slots per token (SKIP of them -1 where t > 1, never the first token's first) and
    softmax weights [T, k] (then the shared expert's sigmoid gate [T, 1] with `shared`)."""
    slots = torch.rand(t, e, device=DEV).argsort(dim=1)[:, :k]
    if t > 1:
        skip = torch.rand(t, k, device=DEV) < SKIP
        skip[0, 0] = False  # (an output that is not all zeros)
        slots[skip] = -1
    weights = torch.softmax(torch.randn(t, k, device=DEV), dim=-1)
    if shared:
        weights = torch.cat([weights, torch.rand(t, 1, device=DEV)], dim=1)
    return slots, weights.to(dtype)


@dataclass(frozen=True)
class Moe:
    h: int
    i: int
    e: int
    k: int
    t: int
    act: torch.dtype
    weights: str = "nvfp4"
    norm: bool = False  # decode block: with the residual add and the next layer's input norm

    def __str__(self) -> str:
        return (f"H{self.h}-I{self.i}-E{self.e}-k{self.k}-T{self.t}-{self.weights}-{NAMES[self.act]}"
                + ("-norm" if self.norm else ""))


# ---- the routed MoE over NVFP4 slots: per-pair (T <= 128) and grouped (T > 128) paths

ROUTED = [
    Moe(128, 64, 8, 1, 1, FP32), Moe(128, 64, 8, 8, 64, BF16), Moe(1024, 256, 64, 2, 63, BF16),
    Moe(2048, 512, 512, 10, 8, BF16), Moe(2560, 640, 512, 10, 1, BF16), Moe(2560, 640, 512, 10, 65, BF16),
    Moe(4096, 768, 512, 1, 2, FP32), Moe(1024, 768, 64, 10, 128, BF16),
]
GROUPED = [  # (fp32 on the short tile only: the long tile in fp32 spills and compiles for ~20 s)
    Moe(2048, 512, 64, 8, 129, FP32), Moe(2560, 640, 512, 10, 2048, BF16), Moe(128, 768, 64, 8, 2049, BF16),
    Moe(4096, 64, 64, 2, 4097, BF16),
]


@pytest.mark.parametrize("c", ROUTED + GROUPED, ids=str)
def test_moe_over_slots(c: Moe):
    """The kernels (the path by T) against the fp32 reference; the dispatcher, with the layer's
    expert count as the grouped grid's bound, gives the same bits."""
    seed(c)
    w = nvfp4_pool(c.e, c.h, c.i)
    x = torch.randn(c.t, c.h, device=DEV).to(c.act)
    slots, weights = routing(c.t, c.k, c.e, c.act)
    out = nan_like(x)
    y = moe_over_slots_triton(x, slots, weights, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_rms(y, moe_over_slots_ref(x.float(), slots, weights.float(), w)) < tol(c.act)
    assert torch.equal(moe_over_slots(x, slots, weights, w, experts=c.e), y)


def block_m(cfg: tuple) -> int:
    """BLOCK_M of a grouped configuration (one tile, or a pair of them sharing it)."""
    return cfg[0][0] if isinstance(cfg[0], tuple) else cfg[0]


EDGES = [(GROUPED_CONFIG_SHORT, Moe(1024, 256, 8, 1, 0, BF16)), (GROUPED_CONFIG, Moe(2560, 640, 8, 1, 0, BF16))]


@pytest.mark.parametrize(("cfg", "c"), EDGES, ids=[
    f"H{c.h}-I{c.i}-E{c.e}-k1-runs{block_m(cfg) - 1}-{block_m(cfg)}-{block_m(cfg) + 1}-nvfp4-{NAMES[c.act]}"
    for cfg, c in EDGES])
def test_moe_grouped_runs_at_tile_edges(cfg: tuple, c: Moe):
    """The grouped path with each library tile, runs of BLOCK_M - 1, BLOCK_M, BLOCK_M + 1, 1,
    2 BLOCK_M and 2 BLOCK_M + 1 pairs on one slot each, and a few skipped pairs, shuffled."""
    bm = block_m(cfg)
    runs = [bm - 1, bm, bm + 1, 1, 2 * bm, 2 * bm + 1]  # pairs of slots 0, 1, ...
    seed((cfg, c))
    w = nvfp4_pool(c.e, c.h, c.i)
    slots = torch.cat([torch.full((r,), s, device=DEV) for s, r in enumerate(runs)]
                      + [torch.full((5,), -1, device=DEV)])
    slots = slots[torch.randperm(slots.numel(), device=DEV)][:, None]  # [T, 1]
    t = slots.shape[0]
    x = torch.randn(t, c.h, device=DEV).to(c.act)
    weights = torch.rand(t, 1, device=DEV).to(c.act)
    y = moe_over_slots_triton(x, slots, weights, w, out=nan_like(x), grouped=True, grouped_config=cfg)
    assert rel_rms(y, moe_over_slots_ref(x.float(), slots, weights.float(), w)) < tol(c.act)
    assert (y[slots[:, 0] < 0] == 0).all()


# ---- the decode MoE block: routed pairs and the shared expert, one sum (optionally the next norm)

DECODE = [
    Moe(128, 64, 8, 1, 1, FP32), Moe(128, 64, 8, 2, DECODE_MAX_TOKENS, BF16),
    Moe(1024, 512, 64, 8, 63, BF16, norm=True), Moe(2048, 512, 512, 10, 64, BF16),
    Moe(2560, 640, 512, 10, 1, BF16, norm=True), Moe(2560, 640, 512, 10, 65, BF16),
    Moe(4096, 768, 512, 10, 8, BF16, norm=True), Moe(4096, 256, 64, 2, 2, FP32),
]


@pytest.mark.parametrize("c", DECODE, ids=str)
def test_moe_decode(c: Moe):
    """moe_decode_triton (down per pair over one or two whole-K tiles, or the K loop for other widths)
    against the fp32 reference, with the next norm against add_rms_norm of the fp32
    reference; the dispatcher gives the same bits."""
    seed(c)
    w, shared = nvfp4_pool(c.e, c.h, c.i), nvfp4_pool(1, c.h, c.i)
    x = torch.randn(c.t, c.h, device=DEV).to(c.act)
    slots, weights = routing(c.t, c.k, c.e, c.act, shared=True)
    ref = moe_decode_ref(x.float(), slots, weights.float(), w, shared)
    out = nan_like(x)
    if not c.norm:
        y = moe_decode_triton(x, slots, weights, w, shared, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert rel_rms(y, ref) < tol(c.act)
        assert torch.equal(moe_decode(x, slots, weights, w, shared), y)
        return
    residual = torch.randn(c.t, c.h, device=DEV).to(c.act)
    norm_w = (torch.randn(c.h, device=DEV) * 0.1).to(c.act)
    x_next, h_next = moe_decode_triton(x, slots, weights, w, shared, out=out, residual=residual, norm_weight=norm_w)
    want_x, want_h = add_rms_norm_ref(ref, residual.float(), norm_w.float(), 1e-6)
    assert rel_rms(h_next, want_h) < tol(c.act) and rel_rms(x_next, want_x) < tol(c.act)
    got = moe_decode(x, slots, weights, w, shared, residual=residual, norm_weight=norm_w)
    assert torch.equal(got[0], x_next) and torch.equal(got[1], h_next)


def test_moe_decode_refuses_more_than_decode_max_tokens():
    """The dispatcher refuses a chunk longer than the per-pair kernels' range (ValueError)."""
    c = Moe(128, 64, 8, 2, DECODE_MAX_TOKENS + 1, BF16)
    seed(c)
    w = nvfp4_pool(c.e, c.h, c.i)
    slots, weights = routing(c.t, c.k, c.e, c.act)
    with pytest.raises(ValueError, match="at most"):
        moe_decode(torch.randn(c.t, c.h, device=DEV).to(c.act), slots, weights, w)


def random_bytes_like(t: torch.Tensor) -> torch.Tensor:
    """Random bytes in t's shape and dtype (a free slot's garbage; any bit pattern, NaNs included)."""
    size = t.element_size()
    return torch.randint(0, 256, (*t.shape[:-1], t.shape[-1] * size), dtype=torch.uint8, device=t.device).view(t.dtype)


HOST = [(Moe(2048, 512, 64, 10, 8, BF16), True), (Moe(128, 64, 8, 1, 1, FP32), True),
        (Moe(2560, 640, 64, 10, 8, BF16), True), (Moe(4096, 768, 8, 2, 2, BF16), True),
        (Moe(1792, 448, 8, 2, 2, BF16), False)]  # (1792 / 8 = 128 + 96 words, 448 / 8 = 32 + 24: refused)


@pytest.mark.parametrize(("c", "supported"), HOST, ids=[f"{c}-{'host' if ok else 'refused'}" for c, ok in HOST])
def test_moe_decode_host_store_and_landing(c: Moe, supported: bool):
    """Experts 0 .. E/4 - 1 resident (slot = id), the rest read from the host store, each missed
    expert's first pair landing it in a distinct free slot. Where both passes take whole-K tiles:
    bit for bit the all-resident result, within tolerance of the fp32 slot-or-host reference, and
    each landing slot then holds the host expert's bytes. Elsewhere (K / 8 not 2^a or 2^a + 2^b) the
    dispatcher raises ValueError before any launch, with or without the landing store."""
    seed(c)
    every = nvfp4_pool(c.e, c.h, c.i)  # every expert in the slot of its id
    r = c.e // 4
    pool = SlotWeights(*(torch.cat([t[:r], random_bytes_like(t[r:])]) for t in every))
    before = SlotWeights(*(t.clone() for t in pool))
    host = SlotWeights(*(t[None].cpu() for t in every))  # [1 layer, E, ...]
    if DEV == "cuda":
        host = SlotWeights(*(t.pin_memory() for t in host))
    shared = nvfp4_pool(1, c.h, c.i)
    x = torch.randn(c.t, c.h, device=DEV).to(c.act)
    ids = torch.rand(c.t, c.e, device=DEV).argsort(dim=1)[:, : c.k]
    if not (ids[0] == c.e - 1).any():
        ids[0, 0] = c.e - 1  # a miss at least (expert E - 1 is not resident)
    slots = torch.where(ids < r, ids, -1)
    _, weights = routing(c.t, c.k, c.e, c.act, shared=True)
    flat = ids.flatten()
    pos = torch.arange(flat.numel(), device=DEV)
    first = torch.full((c.e,), flat.numel(), device=DEV).scatter_reduce(0, flat, pos, "amin")[flat] == pos
    free_of = torch.full((c.e,), -1, device=DEV, dtype=torch.long)
    free_of[r:] = r + torch.randperm(c.e - r, device=DEV)  # a distinct free slot per non-resident expert
    dst = torch.where((slots.flatten() < 0) & first, free_of[flat], -1).view(c.t, c.k).to(torch.int32)
    if not supported:
        for landing in (None, dst):
            with pytest.raises(ValueError, match="whole-K"):
                moe_decode(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=0, topk_dst=landing)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pool, before))
        return
    y = moe_decode(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=0, topk_dst=dst)
    assert torch.equal(y, moe_decode_triton(x, ids, weights, every, shared))
    host_dev = SlotWeights(*(t.to(DEV) for t in host))
    ref = moe_decode_ref(x.float(), slots, weights.float(), before, shared, host=host_dev, topk_ids=ids, layer=0)
    assert rel_rms(y, ref) < tol(c.act)
    landed = {int(dst[p, j]): int(ids[p, j]) for p, j in (dst >= 0).nonzero().tolist()}
    assert landed and (slots < 0).any()
    for s in range(c.e):
        want = every if s in landed else before
        src = landed.get(s, s)
        for got_t, want_t in zip(pool, want):
            assert torch.equal(got_t[s].view(torch.uint8), want_t[src].view(torch.uint8)), s


# ---- bf16 slot pools: the dispatchers run the torch references

DENSE = [Moe(2560, 640, 8, 8, 65, BF16, "bf16"), Moe(2048, 512, 8, 2, 1, FP32, "bf16")]


@pytest.mark.parametrize("c", DENSE, ids=str)
def test_dense_pool_takes_the_reference(c: Moe):
    """Dense (bf16) slot pools have no Triton path: both dispatchers return their reference's
    bits, within tolerance of the fp32 reference."""
    seed(c)
    w, shared = dense_pool(c.e, c.h, c.i), dense_pool(1, c.h, c.i)
    x = torch.randn(c.t, c.h, device=DEV).to(c.act)
    slots, weights = routing(c.t, c.k, c.e, c.act, shared=True)
    routed = weights[:, : c.k]
    assert not runs_triton(w, x.device)
    y = moe_over_slots(x, slots, routed, w)
    assert torch.equal(y, moe_over_slots_ref(x, slots, routed, w))
    fp32_tol = TOL_FP32 if c.act == FP32 else TOL_BF16_REF
    assert rel_rms(y, moe_over_slots_ref(x.float(), slots, routed.float(), w)) < fp32_tol
    yd = moe_decode(x, slots, weights, w, shared)
    assert torch.equal(yd, moe_decode_ref(x, slots, weights, w, shared))
    assert rel_rms(yd, moe_decode_ref(x.float(), slots, weights.float(), w, shared)) < tol(c.act)


# ---- the router: softmax, top-k, renormalization (+ the shared gate's sigmoid and the slots)

@dataclass(frozen=True)
class Route:
    e: int
    k: int
    t: int
    act: torch.dtype
    normalize: bool
    shared: bool  # the decode block's routing: shared gate column and slot table

    def __str__(self) -> str:
        return (f"E{self.e}-k{self.k}-T{self.t}-{NAMES[self.act]}-{'norm' if self.normalize else 'raw'}"
                + ("-shared-table" if self.shared else ""))


ROUTES = [
    Route(8, 1, 1, FP32, True, False), Route(8, 8, 65, BF16, False, True), Route(64, 2, 63, BF16, True, True),
    Route(64, 8, 64, FP32, False, False), Route(512, 10, 1, BF16, True, True), Route(512, 10, 65, BF16, True, False),
    Route(512, 10, 4096, BF16, True, False), Route(512, 1, 2, FP32, False, True),
]


@pytest.mark.parametrize("c", ROUTES, ids=str)
def test_router(c: Route):
    """Distinct logits per row (a permutation of multiples of 1/16 or 1/4 in [-16, 16), exact in
    bf16), so no ties: the same experts in the same order as the fp32 reference; the weights
    within tolerance; the slots exactly; the dispatchers give the same bits."""
    seed(c)
    step = 1 / 16 if c.e >= 64 else 1 / 4
    logits = (torch.rand(c.t, c.e, device=DEV).argsort(dim=1) - c.e // 2) * step
    if c.shared:
        logits = torch.cat([logits, torch.randn(c.t, 1, device=DEV)], dim=1)
    logits = logits.to(c.act)
    table = None
    if c.shared:
        table = torch.randperm(4 * c.e, device=DEV)[: c.e]
        table[torch.rand(c.e, device=DEV) < 0.2] = -1  # experts without a slot
    w, ids, slots = route_triton(logits, c.k, c.normalize, shared_gate=c.shared, slot_table=table)
    w_ref, ids_ref, slots_ref = route_ref(logits.float(), c.k, c.normalize, shared_gate=c.shared, slot_table=table)
    assert torch.equal(ids, ids_ref)
    assert w.dtype == c.act and rel_rms(w, w_ref) < tol(c.act)
    assert (slots is None and slots_ref is None) or torch.equal(slots, slots_ref)
    got = route(logits, c.k, c.normalize, shared_gate=c.shared, slot_table=table)
    assert torch.equal(got[0], w) and torch.equal(got[1], ids)
    w_top, ids_top = router_topk(logits[:, : c.e], c.k, c.normalize)
    assert torch.equal(ids_top, ids) and torch.equal(w_top, router_topk_triton(logits[:, : c.e], c.k, c.normalize)[0])


# ---- the expert lookup (slots, use bookkeeping, landing claims) and the commit

@dataclass(frozen=True)
class Lookup:
    e: int
    k: int
    t: int
    real: int  # rows before the padding
    cap: int  # landing slots reserved
    holes: bool  # some reserved entries -1

    def __str__(self) -> str:
        return f"E{self.e}-k{self.k}-T{self.t}-real{self.real}-R{self.cap}" + ("-holes" if self.holes else "")


LOOKUPS = [Lookup(8, 1, 1, 1, 4, False), Lookup(64, 8, 63, 60, 64, False), Lookup(512, 10, 65, 65, 80, True),
           Lookup(512, 2, 8, 8, 16, False)]


def lookup_case(c: Lookup, layer: int, layers: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Half of each layer's experts resident, `layer`'s landing reserve of c.cap fresh slots: (table, book)."""
    seed(c)
    table = torch.full((layers, c.e), -1, dtype=torch.int64, device=DEV)
    resident = c.e // 2
    for lay in range(layers):
        table[lay, torch.randperm(c.e, device=DEV)[:resident]] = torch.arange(resident, device=DEV) + c.e * lay
    book = new_book(layers, c.e, c.cap, torch.device(DEV))
    book.landing[layer] = 10_000 + torch.randperm(c.cap, device=DEV).to(torch.int32)
    return table, book


def lookup_ids(c: Lookup, table: torch.Tensor, layer: int) -> torch.Tensor:
    """[c.t, c.k] distinct expert ids a row, a miss of `layer` at least in the first (real) row."""
    ids = torch.rand(c.t, c.e, device=DEV).argsort(dim=1)[:, : c.k]
    missed = int((table[layer] < 0).nonzero()[0])
    if not (ids[0] == missed).any():
        ids[0, 0] = missed
    return ids


def owned_lookup_case(c: Lookup, layer: int, hole_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup_case` with victims still mapped in half of `layer`'s landing slots (from every layer; with c.holes
    every `hole_every`-th of the rest -1), step 3 with c.real real rows, and layer 0 looked up before: half its
    experts used this step."""
    table, book = lookup_case(c, layer)
    flat = (table.view(-1) >= 0).nonzero().flatten()
    owned = min(c.cap // 2, len(flat))
    victims = flat[torch.randperm(len(flat), device=DEV)[:owned]]
    book.landing[layer, :owned] = table.view(-1)[victims].int()
    book.owner[layer, :owned] = victims.int()
    if c.holes:
        book.landing[layer, owned::hole_every] = -1
    book.step[0], book.step[1] = 3, c.real
    book.last_use[0, : c.e // 2] = 3
    return table, book


OWNED_LOOKUPS = LOOKUPS + [Lookup(512, 10, 256, 250, 640, False), Lookup(512, 10, 64, 64, 640, True)]


@pytest.mark.parametrize("c", OWNED_LOOKUPS, ids=str)
def test_expert_lookup_owned_and_commit(c: Lookup):
    """The one-program lookup with owners (victims still mapped in half the landing slots, from
    every layer; layer 0 ran before and used some of them) against the reference exactly: slots,
    landing slots, every book field but the scratch, the table after the lookup (claimed victims
    unmapped) and after the commit. Claims follow row order on the device too (no race)."""
    layer = 1
    table, book = owned_lookup_case(c, layer, hole_every=7)
    ids = lookup_ids(c, table, layer)
    ref_book, ref_table = type(book)(*(t.cpu().clone() for t in book)), table.cpu().clone()
    slots, dst = expert_lookup_owned_triton(ids, table, book, layer)
    slots_ref, dst_ref = expert_lookup_ref(ids.cpu(), ref_table, ref_book, layer)
    assert torch.equal(slots.cpu(), slots_ref) and torch.equal(dst.cpu(), dst_ref)
    for name in book._fields:
        if name != "order":
            assert torch.equal(getattr(book, name).cpu(), getattr(ref_book, name)), name
    assert torch.equal(table.cpu(), ref_table)  # the claimed victims unmapped, nothing else
    assert int((ref_book.landed >= 0).sum()) > 0 and int((ref_book.owner >= 0).sum()) > 0
    commit_landed_triton(table, book)
    commit_landed_ref(ref_table, ref_book)
    assert torch.equal(table.cpu(), ref_table)


@pytest.mark.parametrize("forced", [False, True], ids=["routed", "forced"])
@pytest.mark.parametrize("c", [Lookup(512, 10, 1, 1, 12, False), Lookup(512, 10, 1, 1, 80, True),
                               Lookup(64, 8, 1, 1, 16, False), Lookup(8, 1, 1, 1, 4, False)], ids=str)
def test_route_and_owned_lookup_in_one_launch(c: Lookup, forced: bool):
    """One token's routing and owned lookup fused (`route_lookup_owned_triton`, the default of
    the offloaded batch-1 step) against the two launches it replaces: weights and ids equal to `route_triton`'s
    bit for bit, slots, landing slots, the book and the table (claimed victims unmapped) equal to
    `expert_lookup_ref`'s, bf16 logits with the shared gate's column."""
    layer = 1
    table, book = owned_lookup_case(c, layer, hole_every=5)
    missed = (table[layer] < 0).nonzero().flatten()
    logits = torch.randn(1, c.e + 1, device=DEV).to(torch.bfloat16)
    logits[0, missed[: c.k]] += 8.0  # most of the chosen experts miss, so that claims and unmaps happen
    ids_in = lookup_ids(c, table, layer) if forced else None
    ref_book, ref_table = type(book)(*(t.cpu().clone() for t in book)), table.cpu().clone()
    w, ids, slots, dst = route_lookup_owned_triton(logits, c.k, True, table, book, layer, shared_gate=True,
                                                   forced=ids_in)
    w_r, ids_r, _ = route_triton(logits, c.k, True, shared_gate=True, forced=ids_in)
    assert torch.equal(w, w_r) and torch.equal(ids, ids_r)
    slots_ref, dst_ref = expert_lookup_ref(ids.cpu(), ref_table, ref_book, layer)
    assert torch.equal(slots.cpu(), slots_ref) and torch.equal(dst.cpu(), dst_ref)
    for name in book._fields:
        if name != "order":
            assert torch.equal(getattr(book, name).cpu(), getattr(ref_book, name)), name
    assert torch.equal(table.cpu(), ref_table)
    assert int((ref_book.landed >= 0).sum()) > 0


@pytest.mark.parametrize("c", LOOKUPS, ids=str)
def test_expert_lookup_and_commit(c: Lookup):
    """The lookup kernel against the reference on layer 1 of 3: slots and every order-free part of
    the book exactly (rows race for the order of claims: which expert gets which landing slot may
    differ); each landing slot used once, by a missed expert's pair of a real row; then the commit
    maps exactly the kernel's landed experts, and the same ones as the reference's when every
    claim lands."""
    layer = 1
    table, book = lookup_case(c, layer)
    if c.holes:
        book.landing[layer, ::7] = -1
    book.step[0], book.step[1] = 3, c.real
    ids = lookup_ids(c, table, layer)
    ref_book, ref_table = type(book)(*(t.clone() for t in book)), table.clone()
    slots, dst = expert_lookup_triton(ids, table, book, layer)
    slots_ref, dst_ref = expert_lookup_ref(ids, ref_table, ref_book, layer)
    assert torch.equal(slots, slots_ref)
    for name in ("step", "last_use", "claim", "landing", "landing_used", "counters"):
        assert torch.equal(getattr(book, name), getattr(ref_book, name)), name
    assert torch.equal(dst[dst >= 0].sort().values, dst_ref[dst_ref >= 0].sort().values)
    pairs = (dst >= 0).nonzero().tolist()
    assert all(p < c.real and int(slots[p, j]) < 0 for p, j in pairs)
    landed = {int(dst[p, j]): int(ids[p, j]) for p, j in pairs}
    assert len(landed) == len(pairs) == len(set(landed.values()))
    all_land = int(ref_book.landing_used[layer]) <= c.cap and not c.holes
    if all_land:
        assert set(landed.values()) == {int(ids[p, j]) for p, j in (dst_ref >= 0).nonzero().tolist()}
    want = table.clone()  # the kernel's own landings mapped, nothing else changed
    for d, e in landed.items():
        want[layer, e] = d
    commit_landed_triton(table, book)
    commit_landed_ref(ref_table, ref_book)
    assert torch.equal(table, want)
    if all_land:
        assert torch.equal(table >= 0, ref_table >= 0) and table.sort(dim=1).values.equal(ref_table.sort(dim=1).values)


# ---- the NVFP4 linear at the experts' projections: gate_up [2I, H], down [H, I]

@dataclass(frozen=True)
class Linear:
    m: int
    n: int
    k: int
    act: torch.dtype

    def __str__(self) -> str:
        return f"M{self.m}-N{self.n}-K{self.k}-nvfp4-{NAMES[self.act]}"


LINEARS = [
    Linear(1, 128, 128, FP32),  # gate_up H128 I64: the whole-K GEMV, 16 words
    Linear(1, 2560, 640, BF16),  # down of the seeds: the GEMV's K loop, 80 words
    Linear(2, 1280, 2560, BF16),  # gate_up of the seeds, two rows: K loop, 320 words
    Linear(8, 1024, 2048, BF16),  # gate_up H2048 I512: the whole-K GEMV for 8 rows
    Linear(8, 1280, 2560, BF16),  # the 16-row tl.dot tile, halves (EVEN_K)
    Linear(16, 2560, 640, BF16),  # the 16-row tile, K not a multiple of BLOCK_K (no halves, masked K)
    Linear(63, 4096, 768, BF16),  # the 64-row tile
    Linear(65, 1536, 4096, BF16),  # the 256-row tile, the weight as the left operand (SWAP_AB)
    Linear(64, 128, 64, FP32),  # down H128 I64: BLOCK_K above K, ieee fp32
]


@pytest.mark.parametrize("c", LINEARS, ids=str)
def test_nvfp4_linear(c: Linear):
    seed(c)
    packed, scale = nvfp4_weight(c.n, c.k)
    s2 = global_scale(c.k)
    x = torch.randn(c.m, c.k, device=DEV).to(c.act)
    out = nan_like(x, (c.m, c.n))
    y = nvfp4_linear_triton(x, packed, scale, s2, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_rms(y, nvfp4_linear_ref(x.float(), packed, scale, s2)) < tol(c.act)
    assert torch.equal(nvfp4_linear(x, packed, scale, s2), y)


PREFILL_LINEARS = [Linear(DEQUANT_MM_MIN_M, 1280, 2560, BF16), Linear(DEQUANT_MM_MIN_M - 1, 2560, 640, BF16),
                   Linear(4096, 1536, 4096, FP32)]


@pytest.mark.parametrize("c", PREFILL_LINEARS, ids=str)
def test_nvfp4_prefill_linear(c: Linear):
    """The decode pass is the reference's dequantization bit for bit; the dispatcher, given the
    host scale, takes the decode pass + cuBLAS from DEQUANT_MM_MIN_M rows on and the Triton
    kernel below; both within tolerance of the fp32 reference."""
    seed(c)
    packed, scale = nvfp4_weight(c.n, c.k)
    s2 = global_scale(c.k)
    deq = dequantize_nvfp4_triton(packed, scale, c.act, out=torch.full((c.n, c.k), float("nan"), dtype=c.act,
                                                                       device=DEV))
    assert torch.equal(deq, dequantize_nvfp4(packed, scale, 1.0, c.act))
    x = torch.randn(c.m, c.k, device=DEV).to(c.act)
    y = nvfp4_linear(x, packed, scale, s2, float(s2))
    assert rel_rms(y, nvfp4_linear_ref(x.float(), packed, scale, s2)) < tol(c.act)
    if c.m >= DEQUANT_MM_MIN_M:
        want = nvfp4_linear_dequant_mm(x, packed, scale, float(s2), out=nan_like(x, (c.m, c.n)))
    else:
        want = nvfp4_linear_triton(x, packed, scale, s2, out=nan_like(x, (c.m, c.n)))
    assert torch.equal(y, want)
