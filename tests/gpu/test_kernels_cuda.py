"""The Triton kernels compiled for the GPU, at the flagship's shapes (Qwen3-Next-80B-A3B), against
their torch references by relative RMS, in bf16. The interpreter tests (tests/test_kernels_*)
cover small shapes on the CPU; bench/kernels_nvfp4.py times these shapes."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.moe import SlotWeights, moe_over_slots, moe_over_slots_ref
from ft.kernels.moe.kernel import moe_over_slots_triton
from ft.kernels.nvfp4 import nvfp4_linear, nvfp4_linear_ref
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.kernels.router import router_topk, router_topk_ref
from ft.kernels.router.kernel import router_topk_triton
from ft.tools.nvfp4_quantize import quantize_nvfp4

pytestmark = pytest.mark.gpu

TOL_LINEAR = 1e-2  # y rounded to bf16 against the fp32-matmul reference (bench/kernels_nvfp4.py)
TOL_ROUTER = 1e-2  # routing weights in bf16
TOL_MOE = 2e-2  # the MoE reference runs its matmuls in bf16 (bench/kernels_nvfp4.py)

LINEAR_CASES = [(m, n, k) for m in (1, 8, 32, 64, 256) for n, k in ((12288, 2048), (2048, 4096), (1024, 2048))] + [
    (m, n, k) for m in (1, 8) for n, k in ((16384, 2560), (2560, 6144))]
"""(M, N, K): decode, small and larger batches (the 32- and 64-row tiles, each shape's narrow or wide form) and a prefill tile on in_proj_qkvz, out_proj and expert gate_up; and
Qwen3.8-Flash-Next's in_proj_qkvz and out_proj at decode (K 2,560 and 6,144: the GEMV's K loop at M = 1)."""
EXPERTS, TOP_K, HIDDEN, INTER = 512, 10, 2048, 512
DEV = "cuda"


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_nvfp4(n: int, k: int, lead: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random NVFP4 weight [..., N, K]: any byte (every nibble valid), block scales ~ 2**U(-3, 3), scale_2 0.01."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = torch.exp2(torch.empty(*lead, n, k // 16, device=DEV).uniform_(-3, 3)).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor(0.01, device=DEV)


@pytest.mark.parametrize("m, n, k", LINEAR_CASES, ids=[f"M{m}-{n}x{k}-bf16" for m, n, k in LINEAR_CASES])
def test_nvfp4_linear(m, n, k):
    torch.manual_seed(0)
    w = random_nvfp4(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = nvfp4_linear_triton(x, *w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_rms(y, nvfp4_linear_ref(x, *w)) < TOL_LINEAR
    assert torch.equal(nvfp4_linear(x, *w), y)  # the dispatcher runs this kernel on CUDA
    if m <= 8:  # the GEMV's whole-K word decode in PTX (the default) or in Triton: the same bits
        from ft.kernels.nvfp4.kernel import _gemv_config

        gemv = nvfp4_linear_triton(x, *w, path="gemv")
        assert torch.equal(nvfp4_linear_triton(x, *w, path="gemv", config={**_gemv_config(m, n, k), "ASM": False}), gemv)
    if m == 1 and (k // 8) & (k // 8 - 1):  # Flash-Next's K takes two whole-K tiles; the K loop, asked for, agrees
        loop = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_W": 64, "num_warps": 4}
        assert rel_rms(nvfp4_linear_triton(x, *w, path="gemv", config=loop), nvfp4_linear_ref(x, *w)) < TOL_LINEAR
    if m > 2:  # the tl.dot path: its weight decodes (interleaved tiles, halves by PTX)
        from ft.kernels.nvfp4.kernel import _dot_config

        cfg = {**_dot_config(m, n, k), "HALVES": False}
        assert rel_rms(nvfp4_linear_triton(x, *w, path="dot", config=cfg), nvfp4_linear_ref(x, *w)) < TOL_LINEAR
        if m <= 64:  # the halves (`Nvfp4Options.dot_halves`): the PTX decode gives its stand-in's tiles, so the same bits
            halves = nvfp4_linear_triton(x, *w, path="dot", config={**cfg, "HALVES": True})
            assert rel_rms(halves, nvfp4_linear_ref(x, *w)) < TOL_LINEAR
            assert torch.equal(nvfp4_linear_triton(x, *w, path="dot", config={**cfg, "HALVES": True, "ASM": False}),
                               halves)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_e2m1_halves_ptx_is_exact(dtype):
    """The inline-PTX halves decode (byte permutes): every code byte under scales from E4M3 subnormals
    to 448, exactly the reference's dequantized values (the interpreter checks its stand-in alike)."""
    from e2m1_halves_probe import run_probe

    got, ref = run_probe(torch.device(DEV), dtype, asm=True)
    assert torch.equal(got, ref)


def test_e2m1_halves_scaled_ptx_is_exact():
    """The scaled halves' PTX (E4M3 bytes converted two at a time, the decode attention's form): the
    reference's values times 2**-6, exactly, fp16 subnormals included."""
    from e2m1_halves_probe import run_probe

    got, ref = run_probe(torch.device(DEV), torch.float16, asm=True, scaled=True)
    assert torch.equal(got, ref)


def test_e2m1_word_lanes_ptx_is_exact():
    """The whole-K tiles' word decode in inline PTX (`e2m1_word_lanes_f32`, the GEMV and decode MoE
    default): every byte value at every byte position, exactly the reference times 2**-6."""
    from e2m1_halves_probe import run_lanes_probe

    got, ref = run_lanes_probe(torch.device(DEV), asm=True)
    assert torch.equal(got, ref)


PREFILL_LINEAR_CASES = [(m, n, k) for m in (256, 4096) for n, k in ((8192, 2048), (2048, 4096))]


@pytest.mark.parametrize("m, n, k", PREFILL_LINEAR_CASES, ids=[f"M{m}-{n}x{k}-bf16" for m, n, k in PREFILL_LINEAR_CASES])
def test_nvfp4_prefill_linear_through_cublas(m, n, k):
    """The prefill form (one decode pass of the weight, then cuBLAS with alpha = scale_2): the
    decode pass is the reference bit for bit, the linear within the linear tolerance, and the
    dispatcher takes it from DEQUANT_MM_MIN_M rows on when given the host scale (not below)."""
    from ft.kernels.nvfp4 import DEQUANT_MM_MIN_M, dequantize_nvfp4
    from ft.kernels.nvfp4.dequant_kernel import dequantize_nvfp4_triton, nvfp4_linear_dequant_mm

    torch.manual_seed(0)
    packed, scale, s2 = random_nvfp4(n, k)
    assert torch.equal(dequantize_nvfp4_triton(packed, scale, torch.bfloat16),
                       dequantize_nvfp4(packed, scale, 1.0, torch.bfloat16))
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    y = nvfp4_linear_dequant_mm(x, packed, scale, float(s2))
    assert rel_rms(y, nvfp4_linear_ref(x, packed, scale, s2)) < TOL_LINEAR
    dispatched = nvfp4_linear(x, packed, scale, s2, float(s2))
    if m >= DEQUANT_MM_MIN_M:  # the dispatcher takes this path from DEQUANT_MM_MIN_M rows on
        assert torch.equal(dispatched, y)
    else:  # and the Triton kernel below it
        from ft.kernels.nvfp4.kernel import nvfp4_linear_triton

        assert torch.equal(dispatched, nvfp4_linear_triton(x, packed, scale, s2))


ROUTER_CASES = [(t, normalize) for t in (1, 8) for normalize in (True, False)]


@pytest.mark.parametrize("t, normalize", ROUTER_CASES,
                         ids=[f"T{t}-E{EXPERTS}-k{TOP_K}-{'norm' if nm else 'raw'}-bf16" for t, nm in ROUTER_CASES])
def test_router_topk(t, normalize):
    torch.manual_seed(0)
    logits = torch.randn(t, EXPERTS, device=DEV, dtype=torch.bfloat16) * 2
    w, ids = router_topk_triton(logits, TOP_K, normalize)
    w_ref, ids_ref = router_topk_ref(logits, TOP_K, normalize)
    assert w.dtype == torch.bfloat16 and ids.dtype == torch.int64 and ids.shape == (t, TOP_K)
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref))  # the same experts, up to ties
    assert rel_rms(w, w_ref) < TOL_ROUTER
    w_disp, ids_disp = router_topk(logits, TOP_K, normalize)
    assert torch.equal(w_disp, w) and torch.equal(ids_disp, ids)  # the dispatcher runs this kernel on CUDA


def random_pool(slots: int) -> SlotWeights:
    """Random NVFP4 bytes for every slot, per-slot global scales ~ U(0.005, 0.02)."""
    w13, s13, _ = random_nvfp4(2 * INTER, HIDDEN, (slots,))
    w2, s2w, _ = random_nvfp4(HIDDEN, INTER, (slots,))
    return SlotWeights(w13, w2, s13, s2w, torch.empty(slots, 3, device=DEV).uniform_(0.005, 0.02))


def quantized_pool(slots: int) -> SlotWeights:
    """Gaussian weights (std 0.02) quantized as ModelOpt does: realistic codes and scales."""
    w13, s13, w2, s2w, s2 = [], [], [], [], []
    for _ in range(slots):
        gate, up = (quantize_nvfp4(torch.randn(INTER, HIDDEN, device=DEV) * 0.02) for _ in range(2))
        down = quantize_nvfp4(torch.randn(HIDDEN, INTER, device=DEV) * 0.02)
        w13.append(torch.cat([gate[0], up[0]]))
        s13.append(torch.cat([gate[1], up[1]]))
        w2.append(down[0])
        s2w.append(down[1])
        s2.append(torch.stack([gate[2], up[2], down[2]]))
    return SlotWeights(*(torch.stack(t) for t in (w13, w2, s13, s2w, s2)))


POOLS = {f"random{EXPERTS}": lambda: random_pool(EXPERTS), "quantized64": lambda: quantized_pool(64)}


@pytest.fixture(scope="module", params=list(POOLS))
def pool(request) -> SlotWeights:
    torch.manual_seed(0)
    return POOLS[request.param]()


@pytest.mark.parametrize("batch", [1, 8], ids=lambda b: f"B{b}-top{TOP_K}-H{HIDDEN}-I{INTER}-bf16")
def test_moe_over_slots(pool, batch):
    torch.manual_seed(1)
    slots = pool.w13.shape[0]
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=torch.bfloat16)
    topk_slots = torch.stack([torch.randperm(slots, device=DEV)[:TOP_K] for _ in range(batch)])
    topk_weights = torch.softmax(torch.randn(batch, TOP_K, device=DEV), -1).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    y = moe_over_slots_triton(x, topk_slots, topk_weights, pool, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_rms(y, moe_over_slots_ref(x, topk_slots, topk_weights, pool)) < TOL_MOE
    assert torch.equal(moe_over_slots(x, topk_slots, topk_weights, pool), y)  # the dispatcher runs this kernel


@pytest.mark.parametrize("config", ["short", "long"])
def test_moe_grouped_prefill(pool, config):
    """The grouped (prefill) path over 1,024 tokens at the flagship's shapes with both library tiles
    (GROUPED_CONFIG_SHORT, this pass's own, and GROUPED_CONFIG, forced), each with the weight tile
    as the MMA's left operand; the byte-wise weight decode gives the word-wise one's bits."""
    from ft.kernels.moe.grouped_kernel import GROUPED_CONFIG, GROUPED_CONFIG_SHORT

    config = GROUPED_CONFIG_SHORT if config == "short" else GROUPED_CONFIG
    torch.manual_seed(2)
    t, slots = 1024, pool.w13.shape[0]
    x = torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16)
    topk_slots = torch.stack([torch.randperm(slots, device=DEV)[:TOP_K] for _ in range(t)])
    topk_weights = torch.softmax(torch.randn(t, TOP_K, device=DEV), -1).to(torch.bfloat16)
    y = moe_over_slots_triton(x, topk_slots, topk_weights, pool, grouped=True, grouped_config=config)
    assert rel_rms(y, moe_over_slots_ref(x, topk_slots, topk_weights, pool)) < TOL_MOE
    from ft.kernels.options import use_kernel_options, variant  # the byte-wise decode: the same tiles, bitwise

    with use_kernel_options(variant("moe-bytes")):
        assert torch.equal(moe_over_slots_triton(x, topk_slots, topk_weights, pool, grouped=True,
                                                 grouped_config=config), y)


@pytest.mark.parametrize("batch", [1, 8, 16], ids=lambda b: f"B{b}-top{TOP_K}+shared-H{HIDDEN}-I{INTER}-bf16")
def test_moe_decode_with_shared_expert(pool, batch):
    """The decode MoE (routed pairs + the shared expert, one sum) against its fp32 reference; a token's
    result is the same alone and in a batch of others with the same kernel configuration, and the
    same wherever its experts sit."""
    from ft.kernels.moe import moe_decode, moe_decode_ref
    from ft.kernels.moe.decode_kernel import moe_decode_triton

    torch.manual_seed(2)
    slots = pool.w13.shape[0]
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=torch.bfloat16)
    topk_slots = torch.stack([torch.randperm(slots, device=DEV)[:TOP_K] for _ in range(batch)])
    weights = torch.cat([torch.softmax(torch.randn(batch, TOP_K, device=DEV), -1),
                         torch.rand(batch, 1, device=DEV)], dim=1).to(torch.bfloat16)
    y = moe_decode_triton(x, topk_slots, weights, pool, shared, out=torch.full_like(x, float("nan")))
    assert rel_rms(y, moe_decode_ref(x, topk_slots, weights, pool, shared)) < TOL_MOE
    assert torch.equal(moe_decode(x, topk_slots, weights, pool, shared), y)
    perm = torch.randperm(slots, device=DEV)
    moved = SlotWeights(*(t[perm] for t in pool))
    where = torch.argsort(perm)
    assert torch.equal(moe_decode_triton(x, where[topk_slots], weights, moved, shared), y)
    from ft.kernels.options import use_kernel_options, variant

    # the word decode in PTX (default) or Triton: the same bits with fp32 block sums (the fp16 block sums, the
    # default from two tokens, take fma.rn.f16x2 in PTX and a stand-in in Triton: tests/gpu/test_half_sums_cuda.py)
    with use_kernel_options(variant("nvfp4-no-half-sums")):
        y32 = moe_decode_triton(x, topk_slots, weights, pool, shared)
        routed = moe_over_slots_triton(x, topk_slots, weights[:, :TOP_K], pool)
    with use_kernel_options(variant("nvfp4-no-half-sums", "nvfp4-lanes-triton")):
        assert torch.equal(moe_decode_triton(x, topk_slots, weights, pool, shared), y32)
        assert torch.equal(moe_over_slots_triton(x, topk_slots, weights[:, :TOP_K], pool), routed)


@pytest.mark.parametrize("batch", [1, 8])
def test_moe_decode_with_next_norm_equals_two_launches(pool, batch):
    """Flagship shapes, bf16: the sum fused with the residual add and the next input norm equals the
    sum kernel followed by add_rms_norm, bit for bit."""
    from ft.kernels.moe.decode_kernel import moe_decode_triton
    from ft.kernels.norm.kernel import add_rms_norm_triton

    torch.manual_seed(3)
    slots = pool.w13.shape[0]
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=torch.bfloat16)
    residual = torch.randn(batch, HIDDEN, device=DEV, dtype=torch.bfloat16) * 4
    norm_w = torch.randn(HIDDEN, device=DEV, dtype=torch.bfloat16) * 0.1
    topk_slots = torch.stack([torch.randperm(slots, device=DEV)[:TOP_K] for _ in range(batch)])
    weights = torch.cat([torch.softmax(torch.randn(batch, TOP_K, device=DEV), -1),
                         torch.rand(batch, 1, device=DEV)], dim=1).to(torch.bfloat16)
    got = moe_decode_triton(x, topk_slots, weights, pool, shared, residual=residual, norm_weight=norm_w, eps=1e-6)
    want = add_rms_norm_triton(moe_decode_triton(x, topk_slots, weights, pool, shared), residual, norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_moe_decode_reads_slotless_experts_from_pinned_host_memory(pool):
    """Flagship shapes: experts without a slot are read in place from a pinned host store (UVA),
    inside a CUDA graph replayed with new routings; bit for bit the all-resident result."""
    from ft.kernels.moe.decode_kernel import moe_decode_triton

    torch.manual_seed(4)
    n = min(64, pool.w13.shape[0])
    host = SlotWeights(*(t[:n].unsqueeze(0).cpu().pin_memory() for t in pool))  # [1 layer, n experts, ...]
    every = SlotWeights(*(t[:n] for t in pool))
    few = SlotWeights(*(t[:8] for t in pool))  # experts 0..7 have slots 0..7
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    x = torch.randn(8, HIDDEN, device=DEV, dtype=torch.bfloat16)
    weights = torch.cat([torch.softmax(torch.randn(8, TOP_K, device=DEV), -1),
                         torch.rand(8, 1, device=DEV)], dim=1).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n, device=DEV)[:TOP_K] for _ in range(8)])
    slots = torch.where(ids < 8, ids, -1)
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    moe_decode_triton(x, slots, weights, few, shared, host=host, topk_ids=ids, out=out)  # compile
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        moe_decode_triton(x, slots, weights, few, shared, host=host, topk_ids=ids, out=out)
    for _ in range(3):
        ids.copy_(torch.stack([torch.randperm(n, device=DEV)[:TOP_K] for _ in range(8)]))
        slots.copy_(torch.where(ids < 8, ids, -1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_decode_triton(x, ids, weights, every, shared))


def random_bytes_like(t: torch.Tensor) -> torch.Tensor:
    """Random bytes in t's shape and dtype (garbage for a free slot; any bit pattern, NaNs included)."""
    size = t.element_size()
    return torch.randint(0, 256, (*t.shape[:-1], t.shape[-1] * size), dtype=torch.uint8, device=t.device).view(t.dtype)


def test_moe_decode_lands_host_experts_in_free_slots_inside_a_cuda_graph(pool):
    """Flagship shapes: the read-through landing store. Pairs without a slot read their expert in
    place from a pinned host store and, with topk_dst, also write the bytes they read into a free
    slot (one per distinct missed expert), inside a CUDA graph replayed with new routings and
    destinations: each replay's output is bit for bit the all-resident result, every dst slot then
    holds the host expert's bytes exactly (all five tensors) and the resident slots are unchanged."""
    from ft.kernels.moe.decode_kernel import moe_decode_triton

    torch.manual_seed(5)
    n, resident, batch = min(64, pool.w13.shape[0]), 8, 8
    host = SlotWeights(*(t[:n].unsqueeze(0).cpu().pin_memory() for t in pool))  # [1 layer, n experts, ...]
    every = SlotWeights(*(t[:n] for t in pool))
    # experts 0..7 in slots 0..7; slots 8..n-1 free (garbage), enough for every distinct missed expert
    few = SlotWeights(*(torch.cat([t[:resident], random_bytes_like(t[resident:n])]) for t in pool))
    kept = SlotWeights(*(t[:resident].clone() for t in few))
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    x = torch.randn(batch, HIDDEN, device=DEV, dtype=torch.bfloat16)
    weights = torch.cat([torch.softmax(torch.randn(batch, TOP_K, device=DEV), -1),
                         torch.rand(batch, 1, device=DEV)], dim=1).to(torch.bfloat16)

    def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.stack([torch.randperm(n, device=DEV)[:TOP_K] for _ in range(batch)])
        slots = torch.where(ids < resident, ids, -1)
        flat = ids.flatten()
        pos = torch.arange(flat.numel(), device=DEV)
        first = torch.full((n,), flat.numel(), device=DEV).scatter_reduce(0, flat, pos, "amin")[flat] == pos
        free_of = torch.full((n,), -1, device=DEV, dtype=torch.long)
        free_of[resident:] = resident + torch.randperm(n - resident, device=DEV)  # a distinct free slot per expert
        dst = torch.where((slots.flatten() < 0) & first, free_of[flat], -1).view(batch, TOP_K).to(torch.int32)
        return ids, slots, dst

    ids, slots, dst = routing()
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    moe_decode_triton(x, slots, weights, few, shared, host=host, topk_ids=ids, topk_dst=dst, out=out)  # compile
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        moe_decode_triton(x, slots, weights, few, shared, host=host, topk_ids=ids, topk_dst=dst, out=out)
    for _ in range(3):
        new_ids, new_slots, new_dst = routing()
        ids.copy_(new_ids)
        slots.copy_(new_slots)
        dst.copy_(new_dst)
        for t in few:  # fresh garbage in the free slots: what lands must be written by this replay
            t[resident:].copy_(random_bytes_like(t[resident:]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_decode_triton(x, ids, weights, every, shared))
        landed = [(int(dst[t, j]), int(ids[t, j])) for t, j in (dst >= 0).nonzero().tolist()]
        assert landed and len({d for d, _ in landed}) == len(landed)
        for d, e in landed:
            for got, want in zip(few, host):
                assert torch.equal(got[d].cpu().view(torch.uint8), want[0, e].view(torch.uint8)), (d, e)
        for got, want in zip(few, kept):
            assert torch.equal(got[:resident].view(torch.uint8), want.view(torch.uint8))


def test_expert_lookup_and_commit_at_the_flagship_shape():
    """48 MoE layers of 512 experts, 8 rows of top-10: the lookup kernel then the commit kernel
    against their references (same slots, same book, same table after the commit). The order of
    claims among rows may differ from the reference's (atomics), so the comparison is by set."""
    from ft.kernels.expert_lookup import commit_landed_ref, expert_lookup_ref, new_book
    from ft.kernels.expert_lookup.kernel import commit_landed_triton, expert_lookup_triton

    layers, cap, rows = 48, 80, 8
    gen = torch.Generator().manual_seed(5)
    table = torch.full((layers, EXPERTS), -1, dtype=torch.int64)
    for layer in range(layers):
        table[layer, torch.randperm(EXPERTS, generator=gen)[:200]] = torch.arange(200) + 200 * layer
    book = new_book(layers, EXPERTS, cap, torch.device("cpu"))
    book.landing.copy_(torch.arange(layers * cap, dtype=torch.int32).view(layers, cap) + 20_000)
    book.step[0], book.step[1] = 3, rows
    ids = [torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(rows)]) for _ in range(layers)]
    ref_table, ref_book = table.clone(), type(book)(*(t.clone() for t in book))
    dev_table, dev_book = table.to(DEV), type(book)(*(t.to(DEV) for t in book))
    for layer in range(layers):
        s_ref, _ = expert_lookup_ref(ids[layer], ref_table, ref_book, layer)
        s_dev, _ = expert_lookup_triton(ids[layer].to(DEV), dev_table, dev_book, layer)
        assert torch.equal(s_dev.cpu(), s_ref)
    commit_landed_ref(ref_table, ref_book)
    commit_landed_triton(dev_table, dev_book)
    torch.cuda.synchronize()
    assert torch.equal(dev_book.landing_used.cpu(), ref_book.landing_used)
    # the same experts landed, each in a distinct reserved slot, and the tables map the same sets
    for layer in range(layers):
        assert set(dev_table[layer].cpu().tolist()) == set(ref_table[layer].tolist())
        assert torch.equal(dev_table[layer].cpu() >= 0, ref_table[layer] >= 0)
    assert int((ref_table >= 20_000).sum()) > 0
