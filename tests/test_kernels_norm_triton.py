"""The norm and rotary references against the model's functions (bitwise), and the Triton kernels of
`ft.kernels.norm` against the references under the interpreter (fp32, fp16; small shapes)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.norm import (
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    rms_norm,
    rms_norm_ref,
    rotary_inv_freq_ref,
)
from ft.kernels.norm import kernel as details
from triton_flags import spy_launches

TOL = {torch.float32: 1e-6, torch.float16: 1e-3}
"""Relative RMS, Triton against the reference: fp32 differs only in the order of the sum of squares;
fp16 in an occasional last-place rounding where that shows."""
EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference; NaN anywhere in `out` (e.g. an unwritten poisoned output) gives nan."""
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full(x.shape, float("nan"), dtype=x.dtype)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def qk_inputs(t: int, hq: int, hk: int, d: int, r: int, dtype: torch.dtype, seed: int = 0):
    """q as the model takes it (the first half of a [T, Hq, 2D] tensor), k, weights, positions, inv_freq."""
    qg = randn(t, hq, 2 * d, dtype=dtype, seed=seed, scale=2.0)
    k = randn(t, hk, d, dtype=dtype, seed=seed + 1)
    qw, kw = randn(d, dtype=dtype, seed=seed + 2, scale=0.1), randn(d, dtype=dtype, seed=seed + 3, scale=0.1)
    positions = torch.tensor([0, 7, 131071, 3, 250000, 42][:t])
    return qg[..., :d], k, qw, kw, positions, rotary_inv_freq_ref(r, 10000.0, torch.device("cpu"))


ROWS = [(1, 64), (3, 200), (2, 2048)]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
@pytest.mark.parametrize(("t", "d"), ROWS, ids=[f"T{t}-D{d}" for t, d in ROWS])
def test_rms_norm_and_add(t, d, dtype):
    x, res = randn(t, d, dtype=dtype, seed=d, scale=3.0), randn(t, d, dtype=dtype, seed=d + 1)
    w = randn(d, dtype=dtype, seed=d + 2, scale=0.1)
    out = details.rms_norm_triton(x, w, EPS, out=nan_like(x))
    assert rel_rms(out, rms_norm_ref(x, w, EPS)) < TOL[dtype]
    normed, h = details.add_rms_norm_triton(x, res, w, EPS, out=nan_like(x), residual_out=nan_like(x))
    normed_ref, h_ref = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(h, h_ref) and rel_rms(normed, normed_ref) < TOL[dtype]
    in_place = res.clone()
    _, h2 = details.add_rms_norm_triton(x, in_place, w, EPS, residual_out=in_place)
    assert h2 is in_place and torch.equal(in_place, h_ref)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
def test_rms_norm_strided_and_empty(dtype):
    qg = randn(3, 4, 2 * 40, dtype=dtype, seed=5)
    q, w = qg[..., :40], randn(40, dtype=dtype, seed=6, scale=0.1)  # rows of 40 every 80 elements: a view
    assert rel_rms(details.rms_norm_triton(q, w, EPS), rms_norm_ref(q, w, EPS)) < TOL[dtype]
    xt = randn(24, 3, dtype=dtype, seed=7).t()  # unit stride along rows: copied
    assert rel_rms(details.rms_norm_triton(xt, w[:24], EPS), rms_norm_ref(xt, w[:24], EPS)) < TOL[dtype]
    assert details.rms_norm_triton(torch.empty(0, 40, dtype=dtype), w, EPS).shape == (0, 40)


GATED = [(1, 4, 128), (3, 2, 96), (2, 3, 16)]


@pytest.mark.parametrize("weight_fp32", [False, True], ids=["w-act", "w-fp32"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
@pytest.mark.parametrize(("t", "h", "d"), GATED, ids=[f"T{t}-H{h}-D{d}" for t, h, d in GATED])
def test_gated_rms_norm(t, h, d, dtype, weight_fp32):
    x, gate = randn(t, h, d, dtype=dtype, seed=d, scale=3.0), randn(t, h, d, dtype=dtype, seed=d + 1, scale=2.0)
    w = randn(d, dtype=dtype, seed=d + 2, scale=0.1) + 1
    w = w.float() if weight_fp32 else w
    out = details.gated_rms_norm_triton(x, gate, w, EPS, out=nan_like(x))
    assert out.shape == x.shape and rel_rms(out, gated_rms_norm_ref(x, gate, w, EPS)) < TOL[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
def test_gated_rms_norm_sigmoid_gate(dtype):
    """Qwen3.8-Flash-Next's GDN output gate: weight * rmsnorm(x) * sigmoid(z), against the reference
    (and the reference against its formula, so that the two cannot agree on the wrong gate)."""
    x, gate = randn(3, 2, 96, dtype=dtype, seed=5, scale=3.0), randn(3, 2, 96, dtype=dtype, seed=6, scale=2.0)
    w = randn(96, dtype=dtype, seed=7, scale=0.1) + 1
    want = gated_rms_norm_ref(x, gate, w, EPS, "sigmoid")
    xf = x.float()
    formula = w.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * torch.sigmoid(gate.float())
    assert rel_rms(want, formula) < TOL[dtype]
    assert rel_rms(want, gated_rms_norm_ref(x, gate, w, EPS)) > 0.1  # the silu gate differs
    out = details.gated_rms_norm_triton(x, gate, w, EPS, out=nan_like(x), activation="sigmoid")
    assert rel_rms(out, want) < TOL[dtype]
    with pytest.raises(ValueError, match="activation"):
        details.gated_rms_norm_triton(x, gate, w, EPS, activation="tanh")


QK = [(1, 4, 2, 64, 16), (3, 4, 1, 96, 24), (2, 2, 2, 40, 40), (6, 2, 1, 256, 64)]
"""(T, Hq, Hk, D, rotary_dim): partial and full rotary, D and half the rotary dims not powers of 2."""


@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
@pytest.mark.parametrize(("t", "hq", "hk", "d", "r"), QK, ids=[f"T{t}-Hq{hq}-Hk{hk}-D{d}-R{r}" for t, hq, hk, d, r in QK])
def test_qk_norm_rope(t, hq, hk, d, r, dtype):
    q, k, qw, kw, positions, inv_freq = qk_inputs(t, hq, hk, d, r, dtype, seed=d)
    assert q.stride(-1) == 1 and not q.is_contiguous()
    q_ref, k_ref = qk_norm_rope_ref(q, k, qw, kw, positions, inv_freq, r, EPS)
    q_out, k_out = details.qk_norm_rope_triton(q, k, qw, kw, positions, inv_freq, r, EPS,
                                               q_out=nan_like(q), k_out=nan_like(k))
    assert rel_rms(q_out, q_ref) < TOL[dtype] and rel_rms(k_out, k_ref) < TOL[dtype]
    assert r == d or rel_rms(q_out[..., r:], rms_norm_ref(q, qw, EPS)[..., r:]) < TOL[dtype]  # past R: the norm only
    q_in, k_in = torch.cat([q, q], dim=-1)[..., :d], k.clone()  # q strided; both written in place
    q2, k2 = details.qk_norm_rope_triton(q_in, k_in, qw, kw, positions.int(), inv_freq, r, EPS, q_out=q_in, k_out=k_in)
    assert q2 is q_in and k2 is k_in and torch.equal(q_in, q_out) and torch.equal(k_in, k_out)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
def test_norm_rope_of_one_tensor(monkeypatch, dtype):
    """QSA's indexer query (4 heads of 128, the first 64 dims rotated, a strided view of its projection):
    `norm_rope` in one launch of the q/k kernel with no k heads, against its reference, and the
    reference against the model's torch math it replaced (`rotate` of `rms_norm`, bitwise in fp32)."""
    from ft.kernels.norm import norm_rope, norm_rope_ref
    from ft.model.layers.attention import Rope
    from ft.model.layers.qsa_attention import rotate

    x, _, w, _, positions, inv_freq = qk_inputs(5, 4, 1, 128, 64, dtype, seed=9)
    want = norm_rope_ref(x, w, positions, inv_freq, 64, EPS)
    if dtype == torch.float32:
        assert torch.equal(want, rotate(rms_norm_ref(x, w, EPS), positions, Rope(64, inv_freq)))
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    launched = spy_launches(monkeypatch, details, "_qk_norm_rope_kernel")
    got = norm_rope(x, w, positions, inv_freq, 64, EPS)
    assert len(launched) == 1 and got.shape == x.shape
    assert rel_rms(got, want) < TOL[dtype]


EVEN = [64, 40]
"""Row lengths: D == BLOCK_D (the wrappers set EVEN_D: no mask along D) and D < BLOCK_D (masked)."""


@pytest.mark.parametrize("dtype", KERNEL_DTYPES.values(), ids=KERNEL_DTYPES.keys())
@pytest.mark.parametrize("d", EVEN, ids=[f"D{d}" for d in EVEN])
def test_even_d_flag(monkeypatch, d, dtype):
    """Each wrapper sets EVEN_D = (D == BLOCK_D); the kernels with EVEN_D forced off (masks against D)
    give the same results bitwise, and both match the references."""
    even = d == 64
    x, res, gate = (randn(5, 2, d, dtype=dtype, seed=d + i, scale=2.0) for i in range(3))
    w = randn(d, dtype=dtype, seed=d + 3, scale=0.1)
    q, k, qw, kw, positions, inv_freq = qk_inputs(3, 2, 1, d, 16, dtype, seed=d)
    runs = {
        "rms_norm": (lambda: details.rms_norm_triton(x, w, EPS, out=nan_like(x)), lambda: rms_norm_ref(x, w, EPS)),
        "add_rms_norm": (lambda: details.add_rms_norm_triton(x, res, w, EPS, out=nan_like(x), residual_out=nan_like(x)),
                         lambda: add_rms_norm_ref(x, res, w, EPS)),
        "gated_rms_norm": (lambda: details.gated_rms_norm_triton(x, gate, w + 1, EPS, out=nan_like(x)),
                           lambda: gated_rms_norm_ref(x, gate, w + 1, EPS)),
        "qk_norm_rope": (lambda: details.qk_norm_rope_triton(q, k, qw, kw, positions, inv_freq, 16, EPS,
                                                             q_out=nan_like(q), k_out=nan_like(k)),
                         lambda: qk_norm_rope_ref(q, k, qw, kw, positions, inv_freq, 16, EPS)),
    }
    kernels = ("_rms_norm_kernel", "_gated_rms_norm_kernel", "_qk_norm_rope_kernel")
    with monkeypatch.context() as m:
        calls = [spy_launches(m, details, name) for name in kernels]
        outs = {name: run() for name, (run, _) in runs.items()}
    assert [c["EVEN_D"] for c in calls[0] + calls[1] + calls[2]] == [even] * 4
    with monkeypatch.context() as m:
        for name in kernels:
            spy_launches(m, details, name, EVEN_D=False)
        masked = {name: run() for name, (run, _) in runs.items()}
    for name, (_, ref) in runs.items():
        got, want, forced = (v if isinstance(v, tuple) else (v,) for v in (outs[name], ref(), masked[name]))
        assert all(rel_rms(a, b) < TOL[dtype] for a, b in zip(got, want, strict=True)), name
        assert all(torch.equal(a, b) for a, b in zip(got, forced, strict=True)), name


def test_dispatchers(monkeypatch):
    q, k, qw, kw, positions, inv_freq = qk_inputs(2, 2, 1, 32, 8, torch.float32)
    x, w = q.reshape(4, 32), qw
    args = {
        "rms_norm": (x, w, EPS),
        "add_rms_norm": (x, x.flip(0), w, EPS),
        "gated_rms_norm": (x, x.flip(1), w + 1, EPS),
        "qk_norm_rope": (q, k, qw, kw, positions, inv_freq, 8, EPS),
    }
    dispatchers = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "gated_rms_norm": gated_rms_norm,
                   "qk_norm_rope": qk_norm_rope}
    refs = {"rms_norm": rms_norm_ref, "add_rms_norm": add_rms_norm_ref, "gated_rms_norm": gated_rms_norm_ref,
            "qk_norm_rope": qk_norm_rope_ref}
    calls = []
    for name in args:
        real = getattr(details, f"{name}_triton")
        monkeypatch.setattr(details, f"{name}_triton",
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    for name, a in args.items():  # the CPU without the test switch: the references, bitwise
        out, ref = dispatchers[name](*a), refs[name](*a)
        assert all(map(torch.equal, out, ref)) if isinstance(ref, tuple) else torch.equal(out, ref)
    assert not calls
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    for name, a in args.items():
        dispatchers[name](*a)
    assert calls == list(args)
    long = torch.randn(1, details.MAX_D + 1)
    assert torch.equal(rms_norm(long, long[0], EPS), rms_norm_ref(long, long[0], EPS)) and calls == list(args)


def test_bad_input():
    q, k, qw, kw, positions, inv_freq = qk_inputs(2, 2, 1, 32, 8, torch.float32)
    x = q.reshape(4, 32)
    with pytest.raises(ValueError, match="weight"):
        details.rms_norm_triton(x, qw[:16], EPS)
    with pytest.raises(ValueError, match="residual"):
        details.add_rms_norm_triton(x, x.half(), qw, EPS)
    with pytest.raises(ValueError, match="unit stride"):
        details.rms_norm_triton(x, qw, EPS, out=torch.empty(32, 4).t())
    with pytest.raises(ValueError, match="rotary_dim"):
        details.qk_norm_rope_triton(q, k, qw, kw, positions, inv_freq, 6, EPS)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope_ref(q, k, qw, kw, positions, inv_freq, 6, EPS)
    with pytest.raises(ValueError, match="positions"):
        details.qk_norm_rope_triton(q, k, qw, kw, positions[:1], inv_freq, 8, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gated_rms_norm_reads_a_strided_gate_in_place(dtype):
    """The gate as the model passes it: [T, H, D] columns of a wider projection output (no copy)."""
    gen = torch.Generator().manual_seed(4)
    t, h, d = 3, 4, 32
    proj = torch.randn(t, 5 * h * d, generator=gen).to(dtype)  # [mixed | z] as in_proj_qkvz gives them
    z = proj[:, 4 * h * d:].view(t, h, d)
    assert not z.is_contiguous()
    x = torch.randn(t, h, d, generator=gen).to(dtype)
    w = torch.randn(d, generator=gen).to(dtype)
    out = details.gated_rms_norm_triton(x, z, w, EPS, out=nan_like(x))
    ref = gated_rms_norm_ref(x, z.contiguous(), w, EPS)
    assert rel_rms(out, ref) < TOL[dtype]
    assert torch.equal(out, details.gated_rms_norm_triton(x, z.contiguous(), w, EPS))
