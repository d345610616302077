"""The decode attention kernels compiled for the GPU at the flagship's attention shapes (Hq 16, Hkv 2,
D 256, bf16, pages of 64 tokens in a two-layer pool), against the torch reference by relative RMS,
with and without the output gate (a strided view of a q projection, as the model passes it); and a
decode step (KV write + attention) captured in a CUDA graph, replayed with new inputs, equal to eager
bit for bit. The same for NVFP4 caches (uint8 rows of D/2 E2M1 code bytes and D/16 e4m3 block
scales, per-layer K and V scales): the write kernel bit for bit against the reference on the device
and on the CPU, decode (single pass and split-K) and prefill attention against the reference, and
the decode step in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.attention import (
    decode_attention_splits,
    decode_attention_workspace,
    paged_decode_attention,
    paged_decode_attention_ref,
    write_kv_decode,
    write_kv_decode_ref,
)
from ft.kernels.attention.kernel import paged_decode_attention_triton

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPE = torch.bfloat16
HQ, HKV, D, PAGE, LAYERS = 16, 2, 256, 64, 2
SCALE = D ** -0.5
TOL = 1e-2  # bf16 probabilities and output against the fp32 reference
CASES = [(b, ctx) for b in (1, 8) for ctx in (64, 4096, 65536)]


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (an unwritten poisoned output, a leak) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def layer_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1 of the pool [P, L, 2, page, Hkv, D]: non-contiguous [P, page, Hkv, D] views."""
    return kv[:, 1, 0], kv[:, 1, 1]


def make_batch(batch: int, ctx: int):
    """Sequences of lengths up to ctx (the first exactly ctx, the last 1 when batch > 1) on shuffled pages
    of a NaN pool; only their tokens hold K/V, and page-table entries past their pages point at spare
    (NaN) pages. -> (kv, page_table [B, ctx / PAGE + 1] int64, seq_lens [B] int32)."""
    lens = [ctx - (b * 997) % (ctx // 2) for b in range(batch)]
    if batch > 1:
        lens[-1] = 1
    width = ctx // PAGE + 1
    need = [-(-n // PAGE) for n in lens]
    spare = 4
    pages = torch.randperm(sum(need) + spare, device=DEV)
    kv = torch.full((len(pages), LAYERS, 2, PAGE, HKV, D), float("nan"), dtype=DTYPE, device=DEV)
    table = pages[sum(need):][torch.randint(spare, (batch, width), device=DEV)]
    first = 0
    for b, (n, k) in enumerate(zip(lens, need)):
        table[b, :k] = pages[first:first + k]
        first += k
        pos = torch.arange(n, device=DEV)
        kv[table[b, pos // PAGE], :, :, pos % PAGE] = torch.randn(n, LAYERS, 2, HKV, D, device=DEV, dtype=DTYPE)
    return kv, table, torch.tensor(lens, dtype=torch.int32, device=DEV)


def q_and_gate(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] and the output gate as the model slices it from its q projection [B, Hq, 2D]
    (q and gate interleaved per head): a view with strides (2 Hq D, 2D, 1); the q halves are NaN,
    so a gate read outside the gate's columns shows."""
    qg = torch.full((batch, HQ, 2 * D), float("nan"), device=DEV, dtype=DTYPE)
    qg[..., D:] = 2 * torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
    return torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE), qg[..., D:]


@pytest.mark.parametrize("gated", [False, True], ids=["nogate", "gate"])
@pytest.mark.parametrize("batch, ctx", CASES, ids=[f"B{b}-ctx{c}-Hq{HQ}-Hkv{HKV}-D{D}-bf16" for b, c in CASES])
def test_paged_decode_attention(batch, ctx, gated):
    torch.manual_seed(0)
    kv, table, lens = make_batch(batch, ctx)
    k_cache, v_cache = layer_views(kv)
    q, gate = q_and_gate(batch)
    gate = gate if gated else None
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, SCALE, gate=gate)
    splits = decode_attention_splits(batch, HKV, ctx)
    for forced in (None, 1):  # the dispatcher's rule (split-K at 4096 tokens and up), the single pass
        out = torch.full_like(q, float("nan"))
        y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=forced,
                                          out=out, gate=gate)
        assert y.data_ptr() == out.data_ptr()
        assert rel_rms(y, ref) < TOL, f"splits={forced or splits}"
    y_rule = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, gate=gate)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, gate=gate),
                       y_rule)


@pytest.mark.parametrize("splits", [1, 16])
def test_gated_decode_attention_padding_row(splits):
    """A padding row (length 0) gives zeros with the gate too; the gated output is the ungated
    kernels' fp32 result times sigmoid(gate) rounded once, so within two bf16 roundings of the
    rounded ungated output times the gate."""
    torch.manual_seed(0)
    kv, table, lens = make_batch(8, 4096)
    lens[2] = 0
    k_cache, v_cache = layer_views(kv)
    q, gate = q_and_gate(8)
    y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, splits=splits, gate=gate)
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert rel_rms(y, paged_decode_attention_ref(q, k_cache, v_cache, table, lens, SCALE, gate=gate)) < TOL
    ungated = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, splits=splits)
    torch.testing.assert_close(y.float(), ungated.float() * torch.sigmoid(gate.float()), rtol=2 ** -6, atol=1e-5)


def test_write_kv_decode():
    torch.manual_seed(0)
    kv, table, lens = make_batch(8, 4096)
    k, v = (torch.randn(8, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
    pos = lens.long()  # the next token of each sequence
    slots = table.gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
    slots[3] = -1  # a padding row
    expected = kv.clone()
    write_kv_decode_ref(*layer_views(expected), k, v, slots)
    write_kv_decode(*layer_views(kv), k, v, slots)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("gated", [False, True], ids=["nogate", "gate"])
@pytest.mark.parametrize("path", ["single", "split"])
def test_decode_step_in_cuda_graph(path, gated):
    """Persistent inputs, one capture; each replay with new q, K/V, gate, page tables and lengths equals eager."""
    torch.manual_seed(0)
    batch, ctx = 8, 4096
    width = ctx // PAGE
    num_pages = batch * width + 8
    kv = torch.randn(num_pages, LAYERS, 2, PAGE, HKV, D, device=DEV, dtype=DTYPE)
    k_cache, v_cache = layer_views(kv)
    splits = 1 if path == "single" else decode_attention_splits(batch, HKV, ctx)
    assert (splits > 1) == (path == "split")
    ws = decode_attention_workspace(batch, HQ, D, splits, DEV)
    q = torch.empty(batch, HQ, D, device=DEV, dtype=DTYPE)
    qg = torch.empty(batch, HQ, 2 * D, device=DEV, dtype=DTYPE)  # the gate: a view of a q projection
    gate = qg[..., D:] if gated else None
    k_new, v_new = (torch.empty(batch, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
    table = torch.empty(batch, width, dtype=torch.int64, device=DEV)
    lens = torch.empty(batch, dtype=torch.int32, device=DEV)
    slots = torch.empty(batch, dtype=torch.int64, device=DEV)
    out = torch.empty(batch, HQ, D, device=DEV, dtype=DTYPE)

    def step() -> None:
        write_kv_decode(k_cache, v_cache, k_new, v_new, slots)
        paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=splits,
                               workspace=ws, out=out, gate=gate)

    def fill() -> None:
        q.copy_(torch.randn_like(q))
        qg.copy_(2 * torch.randn_like(qg))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        table.copy_(torch.randperm(num_pages, device=DEV)[:batch * width].view(batch, width))
        lens.copy_(torch.randint(1, ctx + 1, (batch,), device=DEV, dtype=torch.int32))
        last = lens.long() - 1  # the new token's position
        slots.copy_(table.gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE)

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        last = lens.long() - 1
        pages = table.gather(1, (last // PAGE)[:, None])[:, 0]
        assert torch.equal(k_cache[pages, last % PAGE], k_new) and torch.equal(v_cache[pages, last % PAGE], v_new)
        eager = paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=splits,
                                       workspace=decode_attention_workspace(batch, HQ, D, splits, DEV), gate=gate)
        assert torch.equal(got, eager)
        assert rel_rms(got, paged_decode_attention_ref(q, k_cache, v_cache, table, lens, SCALE, gate=gate)) < TOL


@pytest.mark.parametrize("kv", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize(("start", "t"), [(0, 512), (1000, 300), (4096, 1)])
def test_prefill_attention_triton_matches_reference(start, t, kv):
    """The Triton prefill attention at the flagship's heads (16 q, 2 kv, D 256, pages of 64) against
    the reference, over a cached prefix: what `PrefillAttentionOptions.triton_on_cuda` rests on."""
    from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton
    from ft.kernels.attention.reference import paged_attention_ref, quantize_kv

    torch.manual_seed(0)
    page, hq, hkv, d = 64, 16, 2, 256
    n = start + t
    pages = torch.randperm(-(-n // page) + 4, device="cuda")[: -(-n // page)]
    shape = (pages.numel() + 4, page, hkv, d)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    scale = None
    if kv == "fp8":
        scale = torch.tensor([0.02, 0.01], device="cuda")
        k, v = quantize_kv(k, scale[0], torch.float8_e4m3fn), quantize_kv(v, scale[1], torch.float8_e4m3fn)
    if kv == "nvfp4":
        scale = torch.tensor([0.004, 0.002], device="cuda")
        k, v = quantize_kv(k, scale[0], torch.uint8), quantize_kv(v, scale[1], torch.uint8)
        assert k.shape[-1] == d // 2 + d // 16
    q = torch.randn(t, hq, 2 * d, device="cuda", dtype=torch.bfloat16)[..., :d]  # a strided view, as the model's
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5, scale)
    variants = [{}, {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "NVFP4_F16": False}, {"CAUSAL_SPLIT": True, "LAZY_RESCALE": False, "NVFP4_F16": False}, {"CAUSAL_SPLIT": True, "LAZY_RESCALE": True}]  # {}: the library's default
    if kv == "nvfp4":
        variants += [{"CAUSAL_SPLIT": True, "NVFP4_F16": True}, {"CAUSAL_SPLIT": True, "NVFP4_F16": True, "BLOCK_N": 32}]
    for cfg in variants:
        got = paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, scale, config=cfg)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, (cfg, err)


# ------------------------------------------------------------------------------------------ NVFP4 KV cache

NVFP4_SCALE = (0.004, 0.002)
"""Layer scales (K, V) of the NVFP4 tests: randn K/V (|x| <= ~5) get block scales ~ 200, in e4m3's range."""


def nvfp4_batch(batch: int, ctx: int):
    """make_batch's pool quantized to NVFP4 (uint8 [P, L, 2, page, Hkv, D/2 + D/16]) on the device by
    the reference: rows of no token (NaN) get NaN block scales, so a read outside a sequence shows.
    -> (kv uint8, page_table, seq_lens, kv_scale [2] float32)."""
    from ft.kernels.attention.reference import quantize_kv

    kv, table, lens = make_batch(batch, ctx)
    scale = torch.tensor(NVFP4_SCALE, device=DEV)
    kv4 = torch.stack([quantize_kv(kv[:, :, i], scale[i], torch.uint8) for i in (0, 1)], dim=2)
    del kv
    return kv4, table, lens, scale


@pytest.mark.parametrize("gated", [False, True], ids=["nogate", "gate"])
@pytest.mark.parametrize("batch, ctx", CASES, ids=[f"B{b}-ctx{c}-Hq{HQ}-Hkv{HKV}-D{D}-nvfp4" for b, c in CASES])
def test_paged_decode_attention_nvfp4(batch, ctx, gated):
    """Decode attention over an NVFP4 cache at the flagship's shapes: the split rule's path and the
    single pass against the reference (which dequantizes in fp32), and the dispatcher."""
    torch.manual_seed(0)
    kv4, table, lens, scale = nvfp4_batch(batch, ctx)
    k_cache, v_cache = layer_views(kv4)
    q, gate = q_and_gate(batch)
    gate = gate if gated else None
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, SCALE, gate=gate, kv_scale=scale)
    splits = decode_attention_splits(batch, HKV, ctx)
    for forced in (None, 1):
        out = torch.full_like(q, float("nan"))
        y = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=forced,
                                          out=out, gate=gate, kv_scale=scale)
        assert rel_rms(y, ref) < TOL, f"splits={forced or splits}"
        for name, cfg in (("NVFP4_F16", {"NVFP4_PRMT": False}), ("NVFP4_HALVES", {"NVFP4_PRMT": False, "NVFP4_F16": False}),
                          ("NVFP4_PRMT 32 keys", {"NVFP4_PRMT": True, "BLOCK_N": 32})):
            yv = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=forced,
                                               gate=gate, kv_scale=scale, config=cfg)
            assert rel_rms(yv, ref) < TOL, f"{name}, splits={forced or splits}"
        # the default (NVFP4_PRMT: the halves decoded in PTX) against its byte-wise stand-in: the same fp16 tiles
        yb = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=forced,
                                           gate=gate, kv_scale=scale, config={"NVFP4_ASM": False})
        assert torch.equal(y, yb), "the PTX decode and the byte-wise one give other fp16 values"
    y_rule = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, gate=gate,
                                           kv_scale=scale)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, gate=gate,
                                              kv_scale=scale), y_rule)


def test_write_kv_decode_nvfp4_bitwise():
    """The NVFP4 decode write on the device: bit for bit the reference on the device and on the CPU
    (IEEE divisions, e4m3 rounding, E2M1 ties), including values that saturate and blocks whose
    scale is an e4m3 subnormal; a padding row writes nothing."""
    from ft.kernels.attention.kernel import write_kv_decode_triton

    torch.manual_seed(0)
    kv4, table, lens, scale = nvfp4_batch(8, 4096)
    mag = torch.logspace(-5, 2, 8 * HKV * D // 16, device=DEV).reshape(8, HKV, D // 16, 1)
    k, v = ((torch.randn(8, HKV, D // 16, 16, device=DEV) * mag).reshape(8, HKV, D).to(DTYPE) for _ in range(2))
    k[0, 0, :16] = torch.tensor([1e4] + [0.5] * 15, device=DEV, dtype=DTYPE)  # block scale clamps: 6s saturate
    pos = lens.long()
    slots = table.gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
    slots[3] = -1
    expected = kv4.clone()
    write_kv_decode_ref(*layer_views(expected), k, v, slots, kv_scale=scale)
    write_kv_decode_triton(*layer_views(kv4), k, v, slots, scale)
    assert torch.equal(kv4, expected)
    from ft.kernels.attention.reference import quantize_kv

    keep = slots >= 0
    rows = slots[keep]
    for i, (cache, x) in enumerate(zip(layer_views(kv4), (k, v))):  # the device's bytes are the CPU reference's
        want = quantize_kv(x[keep].cpu(), scale[i].cpu(), torch.uint8)
        assert torch.equal(cache[rows // PAGE, rows % PAGE].cpu(), want)


@pytest.mark.parametrize("path", ["single", "split"])
def test_decode_step_in_cuda_graph_nvfp4(path):
    """An NVFP4 cache: one capture of write + gated attention; each replay with new inputs writes the
    reference's bytes and gives eager's output bit for bit."""
    from ft.kernels.attention.reference import quantize_kv

    torch.manual_seed(0)
    batch, ctx = 8, 4096
    width = ctx // PAGE
    num_pages = batch * width + 8
    row = D // 2 + D // 16
    kv = torch.randint(0, 256, (num_pages, LAYERS, 2, PAGE, HKV, row), device=DEV, dtype=torch.uint8)
    kv[..., D // 2:] = torch.randint(0x20, 0x50, kv[..., D // 2:].shape, device=DEV, dtype=torch.uint8)  # finite
    k_cache, v_cache = layer_views(kv)
    scale = torch.tensor(NVFP4_SCALE, device=DEV)
    splits = 1 if path == "single" else decode_attention_splits(batch, HKV, ctx)
    ws = decode_attention_workspace(batch, HQ, D, splits, DEV)
    q = torch.empty(batch, HQ, D, device=DEV, dtype=DTYPE)
    qg = torch.empty(batch, HQ, 2 * D, device=DEV, dtype=DTYPE)
    gate = qg[..., D:]
    k_new, v_new = (torch.empty(batch, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
    table = torch.empty(batch, width, dtype=torch.int64, device=DEV)
    lens = torch.empty(batch, dtype=torch.int32, device=DEV)
    slots = torch.empty(batch, dtype=torch.int64, device=DEV)
    out = torch.empty(batch, HQ, D, device=DEV, dtype=DTYPE)

    def step() -> None:
        write_kv_decode(k_cache, v_cache, k_new, v_new, slots, scale)
        paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=splits,
                               workspace=ws, out=out, gate=gate, kv_scale=scale)

    def fill() -> None:
        q.copy_(torch.randn_like(q))
        qg.copy_(2 * torch.randn_like(qg))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        table.copy_(torch.randperm(num_pages, device=DEV)[:batch * width].view(batch, width))
        lens.copy_(torch.randint(1, ctx + 1, (batch,), device=DEV, dtype=torch.int32))
        last = lens.long() - 1
        slots.copy_(table.gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE)

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        last = lens.long() - 1
        pages = table.gather(1, (last // PAGE)[:, None])[:, 0]
        assert torch.equal(k_cache[pages, last % PAGE], quantize_kv(k_new, scale[0], torch.uint8))
        assert torch.equal(v_cache[pages, last % PAGE], quantize_kv(v_new, scale[1], torch.uint8))
        eager = paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE, max_seq_len=ctx, splits=splits,
                                       workspace=decode_attention_workspace(batch, HQ, D, splits, DEV), gate=gate,
                                       kv_scale=scale)
        assert torch.equal(got, eager)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, SCALE, gate=gate, kv_scale=scale)
        assert rel_rms(got, ref) < TOL


@pytest.mark.parametrize(("start", "t", "segment"), [(20000, 1000, 8192), (16384, 4096, 1 << 30), (70001, 77, 30000),
                                                     (65636, 2047, 65536)])
def test_library_prefill_on_cudnn_matches_reference(start, t, segment):
    """Long-prefix chunks on cuDNN (the prefix in segments, the rest on Triton with its log-sum-exp,
    merged) against the reference at the flagship's heads, starts off the page grid and padded query
    rows included; and the dispatcher sends such chunks there (what `PrefillAttentionOptions.library_on_cuda` promises)
    without refusal."""
    from ft.kernels import attention
    from ft.kernels.attention.library_prefill import library_prefill_attention
    from ft.kernels.attention.reference import paged_attention_ref

    torch.manual_seed(1)
    page, hq, hkv, d = 64, 16, 2, 256
    n = start + t
    pages = torch.randperm(-(-n // page) + 4, device="cuda")[: -(-n // page)]
    shape = (pages.numel() + 4, page, hkv, d)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(t, hq, 2 * d, device="cuda", dtype=torch.bfloat16)[..., :d]
    ref = paged_attention_ref(q, k, v, pages, start, d ** -0.5)
    got = library_prefill_attention(q, k, v, pages, start, d ** -0.5, granule=8192, segment_keys=segment)
    assert rel_rms(got, ref) < 1e-2
    from ft.kernels.options import kernel_options

    assert kernel_options().prefill_attention.library_on_cuda  # (the default)
    assert attention.use_library_prefill(q, k, start, None)
    via = attention.paged_attention(q, k, v, pages, start, d ** -0.5)
    assert not attention._library_refused
    assert rel_rms(via, ref) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
@pytest.mark.parametrize(("start", "t"), [(0, 512), (1000, 300), (20000, 77)])
def test_prefill_attention_triton_log_sum_exp(start, t, kv):
    """The Triton prefill kernel's log-sum-exp output (what the library path merges with) against
    `paged_attention_lse_ref`, on the default configuration and the one-loop form."""
    from ft.kernels.attention.prefill_kernel import paged_prefill_attention_triton
    from ft.kernels.attention.reference import paged_attention_lse_ref, quantize_kv

    torch.manual_seed(2)
    page, hq, hkv, d = 64, 16, 2, 256
    n = start + t
    pages = torch.randperm(-(-n // page) + 4, device="cuda")[: -(-n // page)]
    shape = (pages.numel() + 4, page, hkv, d)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    scale = None
    if kv == "nvfp4":
        scale = torch.tensor([0.004, 0.002], device="cuda")
        k, v = quantize_kv(k, scale[0], torch.uint8), quantize_kv(v, scale[1], torch.uint8)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    ref = paged_attention_lse_ref(q, k, v, pages, start, d ** -0.5, scale)
    for cfg in ({}, {"CAUSAL_SPLIT": False, "LAZY_RESCALE": False, "NVFP4_F16": False}):
        lse = torch.full((hq, t), float("nan"), device="cuda")
        paged_prefill_attention_triton(q, k, v, pages, start, d ** -0.5, scale, config=cfg, lse=lse)
        torch.testing.assert_close(lse, ref, rtol=0, atol=2e-2, msg=str(cfg))
