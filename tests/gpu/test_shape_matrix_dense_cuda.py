"""Shape matrix (issue 37) for the dense-activation Triton kernels on the GPU: the norms (RMS norm and
residual add, the gated RMS norm over [T, Hv, Dv] with a strided z, the q/k norm + partial RoPE), the
SiLU gate and expert combine, the dense GEMV, the packed causal conv1d of prefill and the Gated DeltaNet
decode step, each against its torch reference run on the same device (the references compute in fp32
and round where the model rounds), by relative RMS. The chunked delta-rule prefill is not covered here.

The shapes are what a Qwen3-Next-family checkpoint may bring: hidden 128 to 4096; linear-attention
key/value head dims 32 to 256, equal and unequal; 4, 32 or 48 value heads over key heads dividing them
(16 over 48: the seeds' model); attention head dims 64, 128, 256 at rotary factors 0.25, 0.5, 1; conv
widths 2, 3, 4; token counts at the tiles' edges (1, 15/16/17, 63/64/65, 4095/4096/4097) and several
sequences packed with a 1-token and a shorter-than-W-1 one among them; decode batches 1, 8, 64 with a
padding slot (-1); bf16 and fp32.

How the subset was picked (not the product: every distinct constexpr set is a compile): each kernel's
cases list every value of each of its dimensions at least once, and put the risky ones together in one
case: the smallest head dim with the most heads (Hk16-Hv48-Dk32), unequal dims both ways, the largest
dims with one value head per key head, the longest packed runs at 4095/4096/4097 in bf16 (the model's
dtype), T = 1 and tiny shapes in fp32. Each case also runs the dispatcher (the same bits where it takes
the kernel, F.linear where it does not: M > 16 in the GEMV). 43 cases, about 55 compiles.

Every output is NaN-poisoned before the kernel writes it; the state pools are layer 1 of a three-layer
pool, NaN everywhere but the batch's slots: the updated states are compared in full, and every other
slot and layer must stay NaN (neither read, which would spread NaN, nor written).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.kernels.activation import expert_combine, expert_combine_ref, silu_mul, silu_mul_ref
from ft.kernels.activation.kernel import expert_combine_triton, silu_mul_triton
from ft.kernels.conv1d import causal_conv1d_varlen, causal_conv1d_varlen_ref
from ft.kernels.conv1d.kernel import causal_conv1d_varlen_triton
from ft.kernels.options import use_kernel_options, variant
from ft.kernels.dense import dense_linear, dense_linear_ref, uses_dense_kernel
from ft.kernels.dense.kernel import dense_linear_triton
from ft.kernels.gated_delta import gated_delta_decode, gated_delta_decode_ref
from ft.kernels.gated_delta.kernel import gated_delta_decode_triton
from ft.kernels.norm import add_rms_norm, gated_rms_norm, qk_norm_rope, rms_norm
from ft.kernels.norm import kernel as norm_details
from ft.kernels.norm.reference import (
    add_rms_norm_ref,
    gated_rms_norm_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    rotary_inv_freq_ref,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
FP32, BF16 = torch.float32, torch.bfloat16
DTYPE_NAMES = {FP32: "fp32", BF16: "bf16"}
TOL = {FP32: 1e-5, BF16: 4e-3}
"""Relative RMS against the reference. fp32: the kernels sum in another order (and fma contracts), a few
ulp of fp32 (2**-24) per element at most. bf16: the kernels round where the references round, so only an
fp32 intermediate (a sum, rsqrt, exp, cos) that lands on the other side of a bf16 rounding differs, by
one bf16 step (2**-8) on a few elements: well under 2**-8 as an RMS."""
EPS, THETA = 1e-6, 10_000_000.0
LAYERS, LAYER = 3, 1


@pytest.fixture(autouse=True, scope="module")
def _fp32_references():
    """The references' fp32 convs in full fp32: cuDNN may take TF32 for them by default."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.backends.cudnn, "allow_tf32", False)
        m.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        yield


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """rel_rms(out, ref) below TOL of the activation dtype."""
    err, tol = rel_rms(out, ref), TOL[dtype]
    assert err < tol, f"{what}: relative RMS {err:.3e}, tolerance {tol:.0e}"


def generator(*key: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(hash(key) % 2**31)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = FP32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(dtype)


def nans(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return nans(*x.shape, dtype=x.dtype)


def case_ids(cases: list[tuple], fmt) -> list[str]:
    return [fmt(*c[:-1]) + "-" + DTYPE_NAMES[c[-1]] for c in cases]


# --- norms --------------------------------------------------------------------------------------------

RMS_CASES = [(128, 1, FP32), (1024, 17, BF16), (2048, 4097, BF16), (2560, 65, BF16), (4096, 16, FP32)]
"""(D = hidden, T, dtype): every hidden size; 2560 is not a power of two (masked rows)."""


@pytest.mark.parametrize(("d", "t", "dtype"), RMS_CASES, ids=case_ids(RMS_CASES, lambda d, t: f"D{d}-T{t}"))
def test_rms_norm_and_add(d, t, dtype):
    gen = generator(d, t)
    x, res = randn(gen, t, d, dtype=dtype, scale=3.0), randn(gen, t, d, dtype=dtype)
    w = randn(gen, d, dtype=dtype, scale=0.1)
    y = norm_details.rms_norm_triton(x, w, EPS, out=nan_like(x))
    assert_close(y, rms_norm_ref(x, w, EPS), dtype, "rms_norm")
    assert torch.equal(rms_norm(x, w, EPS), y)  # the dispatcher takes the kernel
    normed, h = norm_details.add_rms_norm_triton(x, res, w, EPS, out=nan_like(x), residual_out=nan_like(x))
    normed_ref, h_ref = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(h, h_ref)  # one rounded add, as torch's
    assert_close(normed, normed_ref, dtype, "add_rms_norm")
    in_place = res.clone()
    normed_d, h_d = add_rms_norm(x, res, w, EPS)
    norm_details.add_rms_norm_triton(x, in_place, w, EPS, residual_out=in_place)
    assert torch.equal(in_place, h) and torch.equal(h_d, h) and torch.equal(normed_d, normed)


GATED_CASES = [
    (4, 32, 15, False, FP32), (48, 32, 4097, False, BF16), (32, 128, 63, False, BF16),
    (48, 128, 17, False, BF16), (32, 256, 16, False, FP32), (4, 64, 65, True, BF16),
]
"""(Hv, Dv, T, fp32 weight, dtype): every value head count and dim; 48 heads of 32 (the most rows of the
fewest elements) over 4097 tokens; T * Hv rows that end in a partial block of the kernel's rows per program;
a bf16 norm with an fp32 weight."""


@pytest.mark.parametrize(("hv", "dv", "t", "w_fp32", "dtype"), GATED_CASES, ids=case_ids(
    GATED_CASES, lambda hv, dv, t, w: f"Hv{hv}-Dv{dv}-T{t}" + ("-wfp32" if w else "")))
def test_gated_rms_norm(hv, dv, t, w_fp32, dtype):
    gen = generator(hv, dv, t)
    x = randn(gen, t, hv, dv, dtype=dtype, scale=3.0)  # the delta rule's o
    qkvz = randn(gen, t, 2 * hv * dv + 64, dtype=dtype, scale=2.0)
    z = qkvz[:, hv * dv + 64:].view(t, hv, dv)  # as the model's: a strided view of in_proj_qkvz's output
    w = randn(gen, dv, scale=0.1) + 1
    w = w if w_fp32 else w.to(dtype)
    y = norm_details.gated_rms_norm_triton(x, z, w, EPS, out=nan_like(x))
    assert_close(y, gated_rms_norm_ref(x, z, w, EPS), dtype, "gated_rms_norm")
    assert torch.equal(gated_rms_norm(x, z, w, EPS), y)


QK_CASES = [
    (8, 1, 64, 1.0, 1, FP32), (32, 8, 64, 0.25, 64, BF16), (32, 4, 128, 0.5, 17, BF16),
    (16, 16, 128, 1.0, 15, FP32), (16, 2, 256, 0.25, 4097, BF16), (16, 2, 256, 1.0, 65, FP32),
]
"""(Hq, Hk, head dim, rotary factor, T, dtype): each head dim at two rotary factors (rotary halves of 8 to
128 dims); the flagship's 16 x 256 over 2 at 0.25 over 4097 tokens."""


@pytest.mark.parametrize(("hq", "hk", "d", "factor", "t", "dtype"), QK_CASES,
                         ids=case_ids(QK_CASES, lambda hq, hk, d, f, t: f"Hq{hq}-Hk{hk}-D{d}-R{int(d * f)}-T{t}"))
def test_qk_norm_rope(hq, hk, d, factor, t, dtype):
    gen = generator(hq, hk, d, t)
    r = int(d * factor)
    qg = randn(gen, t, hq, 2 * d, dtype=dtype, scale=2.0)
    q = qg[..., :d]  # the model's q: a strided view of [q | gate]
    k = randn(gen, t, hk, d, dtype=dtype)
    qw, kw = randn(gen, d, dtype=dtype, scale=0.1), randn(gen, d, dtype=dtype, scale=0.1)
    positions = torch.randint(0, 262_144, (t,), device=DEV, generator=gen)
    inv_freq = rotary_inv_freq_ref(r, THETA, torch.device(DEV))
    q_ref, k_ref = qk_norm_rope_ref(q, k, qw, kw, positions, inv_freq, r, EPS)
    q_out, k_out = norm_details.qk_norm_rope_triton(q, k, qw, kw, positions, inv_freq, r, EPS,
                                                    q_out=nan_like(q), k_out=nan_like(k))
    assert_close(q_out, q_ref, dtype, "q")
    assert_close(k_out, k_ref, dtype, "k")
    q_d, k_d = qk_norm_rope(q, k, qw, kw, positions, inv_freq, r, EPS)
    assert torch.equal(q_d, q_out) and torch.equal(k_d, k_out)
    gate = qg[..., d:].clone()
    norm_details.qk_norm_rope_triton(q, k, qw, kw, positions, inv_freq, r, EPS, q_out=q, k_out=k)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)  # in place, q inside qg
    assert torch.equal(qg[..., d:], gate)  # the gate half untouched


# --- SiLU gate and expert combine ---------------------------------------------------------------------

ACT_CASES = [(1, 128, 96, FP32), (17, 2048, 512, BF16), (4097, 4096, 1536, BF16), (64, 2560, 5120, FP32),
             (15, 1024, 1025, BF16)]
"""(T, H = hidden, I = intermediate, dtype): I within one 1024-column block, at its edge and past it."""


@pytest.mark.parametrize(("t", "h", "i", "dtype"), ACT_CASES,
                         ids=case_ids(ACT_CASES, lambda t, h, i: f"T{t}-H{h}-I{i}"))
def test_silu_mul_and_expert_combine(t, h, i, dtype):
    gen = generator(t, h, i)
    gate_up = randn(gen, t, 2 * i, dtype=dtype, scale=3.0)  # strided halves, as a fused gate_up projection
    gate, up = gate_up[:, :i], gate_up[:, i:]
    y = silu_mul_triton(gate, up, out=nans(t, i, dtype=dtype))
    assert_close(y, silu_mul_ref(gate, up), dtype, "silu_mul")
    assert torch.equal(silu_mul(gate, up), y)
    routed, shared = randn(gen, t, h, dtype=dtype), randn(gen, t, h, dtype=dtype)
    gate_logit = randn(gen, t, 1, dtype=dtype, scale=3.0)
    y = expert_combine_triton(routed, shared, gate_logit, out=nan_like(routed))
    assert_close(y, expert_combine_ref(routed, shared, gate_logit), dtype, "expert_combine")
    assert torch.equal(expert_combine(routed, shared, gate_logit), y)


# --- dense GEMV ---------------------------------------------------------------------------------------

DENSE_CASES = [
    (1, 1, 2048, BF16), (8, 64, 2048, BF16), (1, 96, 4096, BF16), (8, 512, 2560, BF16), (16, 256, 1024, FP32),
    (3, 8, 128, FP32), (64, 512, 2048, BF16), (64, 96, 4096, FP32), (1, 513, 2560, BF16), (8, 96, 2560, BF16),
    (5, 64, 2096, BF16),
]
"""(M = decode batch, N, K = hidden, dtype): the shared-expert gate (N 1), in_proj_ba (N = 2 * Hv: 8, 64,
96), routers (256, 512; Flash-Next's 513 with the shared gate); K in one tile (up to 4 KB a row), in several
(4096: two bf16 tiles, four fp32 ones), with a last tile of its own (2560 in bf16: 2048 + 512, Flash-Next's
router and in_proj_ba) and with a masked last one (2096: 2048 + 48; the dispatcher takes K in multiples of 16); batches 1 to 16 take the kernel, 64 F.linear (above the
dispatcher's `DenseOptions.max_m`, 16)."""


@pytest.mark.parametrize(("m", "n", "k", "dtype"), DENSE_CASES,
                         ids=case_ids(DENSE_CASES, lambda m, n, k: f"M{m}-N{n}-K{k}"))
def test_dense_linear(m, n, k, dtype):
    gen = generator(m, n, k)
    x, w = randn(gen, m, k, dtype=dtype), randn(gen, n, k, dtype=dtype, scale=0.05)
    y = dense_linear_triton(x, w, out=nans(m, n, dtype=dtype))
    assert_close(y, dense_linear_ref(x, w), dtype, "dense_linear_triton")
    y_d = dense_linear(x, w)
    if m <= 16:
        assert uses_dense_kernel(x, w) and torch.equal(y_d, y)
    else:  # refused (M above `DenseOptions.max_m`): F.linear, as it is
        assert not uses_dense_kernel(x, w) and torch.equal(y_d, F.linear(x, w))


# --- Gated DeltaNet: packed conv1d (prefill) and the decode step --------------------------------------


def channels(hk: int, hv: int, dk: int, dv: int) -> int:
    """C of the mixed q, k, v channels: 2 * Hk * Dk + Hv * Dv."""
    return 2 * hk * dk + hv * dv


def projections(gen: torch.Generator, rows: int, c: int, hv: int, dv: int, dtype: torch.dtype) -> torch.Tensor:
    """mixed [rows, C] as the model's: the first C columns of in_proj_qkvz's output [rows, C + Hv * Dv]."""
    return randn(gen, rows, c + hv * dv, dtype=dtype, scale=2.0)[:, :c]


def state_pools(gen: torch.Generator, slots: torch.Tensor, c: int, width: int, dtype: torch.dtype,
                ssm_dims: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """conv pool [S, L, C, W-1] in dtype, ssm pool [S, L, Hv, Dk, Dv] fp32 (if ssm_dims): NaN but at
    (slots >= 0, LAYER), which are random; region [S, L] bool: where the states are."""
    n_slots = slots.numel() + 7
    used = slots[slots >= 0]
    conv = nans(n_slots, LAYERS, c, width - 1, dtype=dtype)
    conv[used, LAYER] = randn(gen, len(used), c, width - 1, dtype=dtype, scale=2.0)
    ssm = None
    if ssm_dims is not None:
        ssm = nans(n_slots, LAYERS, *ssm_dims, dtype=FP32)
        ssm[used, LAYER] = randn(gen, len(used), *ssm_dims, scale=0.3)
    region = torch.zeros(n_slots, LAYERS, dtype=torch.bool, device=DEV)
    region[used, LAYER] = True
    return conv, ssm, region


def assert_pool(pool: torch.Tensor, ref: torch.Tensor, region: torch.Tensor, dtype: torch.dtype, what: str,
                exact: bool = False) -> None:
    """The states at region as the reference's (bitwise if exact); every other slot and layer still NaN."""
    if exact:
        assert torch.equal(pool[region], ref[region]), f"{what}: states differ from the reference's copy"
    else:
        assert_close(pool[region], ref[region], dtype, what)
    assert pool[~region].isnan().all(), f"{what}: a slot or layer outside the batch was written"


CONV_CASES = [
    (2, 4, 32, 32, 4, (1, 2, 15, 16, 17), FP32), (16, 48, 128, 128, 4, (4097, 1, 2, 63), BF16),
    (16, 32, 128, 128, 4, (64, 4096, 65), BF16), (4, 32, 64, 128, 3, (1, 4095, 16, 1), BF16),
    (8, 32, 128, 64, 2, (63, 0, 1, 17), FP32),
]
"""(Hk, Hv, Dk, Dv, W, lengths, dtype): C from 256 to 10240 (always a multiple of the 64-channel block
for these heads); lengths on both sides of the 16-token tiles, 4095-4097 after and before other
sequences, a 1-token and a shorter-than-W-1 sequence (2 at W 4, 1 at W 3) and, at W 2, an empty one."""


@pytest.mark.parametrize("kernel", ["tiles", "rows"])
@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "width", "lengths", "dtype"), CONV_CASES,
                         ids=case_ids(CONV_CASES, lambda hk, hv, dk, dv, w, lens:
                                      f"Hk{hk}-Hv{hv}-Dk{dk}-Dv{dv}-W{w}-T{'+'.join(map(str, lens))}"))
def test_conv1d_varlen(hk, hv, dk, dv, width, lengths, dtype, kernel):
    """Both packed conv kernels (the rows, the default; the tiles, variant "conv1d-tiles") against the reference,
    at their launch choices for these shapes."""
    with use_kernel_options(variant(*(("conv1d-tiles",) if kernel == "tiles" else ()))):
        _check_conv1d_varlen(hk, hv, dk, dv, width, lengths, dtype)


def _check_conv1d_varlen(hk, hv, dk, dv, width, lengths, dtype):
    gen = generator(hk, hv, dk, dv, width, *lengths)
    c, t = channels(hk, hv, dk, dv), sum(lengths)
    x = projections(gen, t, c, hv, dv, dtype)
    weight = randn(gen, c, width, dtype=dtype, scale=0.4)
    cu = torch.tensor((0, *lengths), device=DEV).cumsum(0).to(torch.int32)
    slots = torch.randperm(len(lengths) + 7, device=DEV, generator=gen)[: len(lengths)]
    if width == 3:
        cu, slots = cu.long(), slots.int()  # int64 offsets and int32 slots too
    conv, _, region = state_pools(gen, slots, c, width, dtype)
    conv_ref, conv_t, conv_d = conv.clone(), conv.clone(), conv.clone()
    y_ref = causal_conv1d_varlen_ref(x, conv_ref[:, LAYER], weight, cu, slots)
    y = causal_conv1d_varlen_triton(x, conv_t[:, LAYER], weight, cu, slots, out=nans(t, c, dtype=dtype))
    assert_close(y, y_ref, dtype, "y")
    per_seq = [rel_rms(y[a:b], y_ref[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    assert max(per_seq) < TOL[dtype], f"per sequence {per_seq}"  # a wrong offset shows in one sequence
    assert not torch.equal(conv_ref[region], conv[region])  # the states did change
    assert_pool(conv_t, conv_ref, region, dtype, "conv state", exact=True)  # copies: bit-exact
    assert torch.equal(causal_conv1d_varlen(x, conv_d[:, LAYER], weight, cu, slots), y)
    assert torch.equal(conv_d.nan_to_num(), conv_t.nan_to_num())


DECODE_CASES = [
    (1, 2, 4, 32, 32, 4, False, FP32), (8, 16, 48, 128, 128, 4, True, BF16), (64, 16, 32, 128, 128, 4, True, BF16),
    (8, 4, 32, 64, 128, 3, False, BF16), (64, 8, 32, 128, 64, 4, True, FP32), (64, 16, 48, 32, 32, 2, True, FP32),
    (1, 4, 4, 256, 256, 4, False, FP32), (8, 1, 4, 256, 64, 3, True, BF16),
]
"""(B, Hk, Hv, Dk, Dv, W, padding row, dtype): the seeds' model (16 over 48 of 128) and the flagship's
(16 over 32); Dk < Dv and Dk > Dv; 48 value heads of 32 at batch 64; 256-dim heads one value head per key
head, and four per key head; a padding slot (-1) in the middle of every batch of 8 or 64."""


@pytest.mark.parametrize(("bsz", "hk", "hv", "dk", "dv", "width", "pad", "dtype"), DECODE_CASES,
                         ids=case_ids(DECODE_CASES, lambda b, hk, hv, dk, dv, w, p:
                                      f"B{b}-Hk{hk}-Hv{hv}-Dk{dk}-Dv{dv}-W{w}" + ("-pad" if p else "")))
def test_gated_delta_decode(bsz, hk, hv, dk, dv, width, pad, dtype):
    gen = generator(bsz, hk, hv, dk, dv, width)
    c = channels(hk, hv, dk, dv)
    slots = torch.randperm(bsz + 7, device=DEV, generator=gen)[:bsz]
    if pad:
        slots[bsz // 2] = -1
    conv, ssm, region = state_pools(gen, slots, c, width, dtype, (hv, dk, dv))
    ba = randn(gen, bsz, 2 * hv, dtype=dtype)  # b and a as the model's views of in_proj_ba's output
    args = (projections(gen, bsz, c, hv, dv, dtype), ba[:, :hv], ba[:, hv:])
    a_log = (torch.rand(hv, device=DEV, generator=gen) * 15 + 1).log().to(dtype)
    params = (randn(gen, c, width, dtype=dtype, scale=0.4), a_log, randn(gen, hv, dtype=dtype, scale=0.5))

    def step(fn, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        conv_c, ssm_c = conv.clone(), ssm.clone()
        return fn(*args, conv_c[:, LAYER], ssm_c[:, LAYER], *params, slots, **kw), conv_c, ssm_c

    o_ref, conv_ref, ssm_ref = step(gated_delta_decode_ref)
    out = nans(bsz, hv, dv, dtype=dtype)
    o, conv_t, ssm_t = step(gated_delta_decode_triton, out=out)
    valid = slots >= 0
    assert o is out and torch.equal(o[~valid], torch.zeros_like(o[~valid]))  # padding rows give zeros
    assert_close(o[valid], o_ref[valid], dtype, "o")
    assert_pool(conv_t, conv_ref, region, dtype, "conv state", exact=True)  # a shifted copy: bit-exact
    assert_pool(ssm_t, ssm_ref, region, dtype, "ssm state")
    o_d, conv_d, ssm_d = step(gated_delta_decode)  # the dispatcher takes the kernels: the same bits
    assert torch.equal(o_d, o) and torch.equal(conv_d.nan_to_num(), conv_t.nan_to_num())
    assert torch.equal(ssm_d.nan_to_num(), ssm_t.nan_to_num())
