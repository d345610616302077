"""Triton NVFP4 linear (GEMV and tl.dot paths) against `nvfp4_linear_ref`, under the interpreter on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.nvfp4 import nvfp4_linear, nvfp4_linear_ref
from ft.tools.nvfp4_quantize import quantize_nvfp4
from ft.kernels.nvfp4.kernel import nvfp4_linear_triton
from ft.model.qwen3_8_flash_next import FlashNextModel

# Relative RMS tolerances: the kernels accumulate in fp32 like the reference, so what is left
# is summation order (fp32) and the final rounding of y (fp16, bf16).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# (M, N, K, dtype, path or None for the default); bf16 only on the GEMV path (the interpreter's bf16 tl.dot is wrong).
CASES = [
    (1, 64, 128, torch.float32, "gemv"),
    (1, 40, 96, torch.bfloat16, "gemv"),
    (3, 24, 272, torch.float16, "gemv"),
    (8, 64, 64, torch.bfloat16, "gemv"),
    (16, 33, 128, torch.float32, "gemv"),
    (17, 64, 128, torch.float16, "dot"),
    (40, 72, 160, torch.float32, "dot"),
    (5, 16, 64, torch.float16, "dot"),
    (12, 48, 96, torch.float16, None),  # the launcher's own choice (16-row dot tile)
    (5, 24, 2048, torch.bfloat16, None),  # the launcher's own choice (whole-K GEMV for 5 rows)
]

FLASH_NEXT_F16_ROWS = dict(FlashNextModel.kernel_defaults)
"""The fp16 rows as Qwen3.8-Flash-Next chooses them (`Nvfp4Options.dot_f16_x_max_m`)."""


def _case_id(case) -> str:
    m, n, k, dtype, path = case
    return f"M{m}-N{n}-K{k}-{DTYPE_NAMES[dtype]}-{path or 'auto'}"


def _rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten elements?)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _weight(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3  # rows of varied size
    return quantize_nvfp4(w)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_nvfp4_linear_triton_matches_ref(case):
    m, n, k, dtype, path = case
    gen = torch.Generator().manual_seed(hash(_case_id(case)) % 2**31)
    packed, scale, scale_2 = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = nvfp4_linear_triton(x, packed, scale, scale_2, out=out, path=path)
    assert y is out and y.shape == (m, n) and y.dtype == dtype
    assert _rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < TOL[dtype]


def test_nvfp4_linear_triton_strided_x_and_float_scale_2():
    gen = torch.Generator().manual_seed(7)
    packed, scale, scale_2 = _weight(32, 64, gen)
    x = torch.randn(64, 4, generator=gen).T  # [4, 64], not contiguous
    y = nvfp4_linear_triton(x, packed, scale, float(scale_2))
    assert _rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < TOL[torch.float32]


def test_dispatcher_uses_triton_when_asked(monkeypatch):
    import ft.kernels.nvfp4.kernel as details

    calls = []
    real = details.nvfp4_linear_triton
    monkeypatch.setattr(details, "nvfp4_linear_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    packed, scale, scale_2 = _weight(16, 32, gen)
    x = torch.randn(2, 32, generator=gen)
    monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    nvfp4_linear(x, packed, scale, scale_2)
    assert not calls  # CPU without the test flag: the reference
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    y = nvfp4_linear(x, packed, scale, scale_2)
    assert calls
    assert _rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < TOL[torch.float32]


def test_bad_shapes_raise():
    packed, scale, scale_2 = quantize_nvfp4(torch.randn(16, 32))
    with pytest.raises(ValueError):
        nvfp4_linear_triton(torch.randn(2, 48), packed, scale, scale_2)
    with pytest.raises(ValueError):
        nvfp4_linear_triton(torch.randn(2, 32), packed, scale.float(), scale_2)



# (M, N, K, BLOCK_M, BLOCK_N, BLOCK_W): GEMV tiles that end past N and past K
GEMV_CONFIGS = [
    (1, 40, 256, 1, 16, 4),
    (1, 40, 272, 1, 4, 8),
    (2, 24, 512, 2, 8, 8),
    (5, 16, 96, 8, 16, 4),
]


@pytest.mark.parametrize("case", GEMV_CONFIGS, ids=lambda c: "M{}-N{}-K{}-bm{}-bn{}-bw{}".format(*c))
def test_gemv_configs_match_ref(case):
    m, n, k, bm, bn, bw = case
    gen = torch.Generator().manual_seed(n * k + bw)
    packed, scale, scale_2 = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_W": bw}
    y = nvfp4_linear_triton(x, packed, scale, scale_2, out=out, path="gemv", config=cfg)
    assert _rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < TOL[torch.bfloat16]


@pytest.mark.parametrize(("m", "n", "k", "bm", "bn"), [(1, 40, 256, 1, 16), (1, 8, 512, 1, 4), (1, 5, 128, 1, 8),
                                                     (3, 24, 256, 4, 8), (8, 16, 128, 8, 2)])
def test_gemv_whole_k_matches_ref(m, n, k, bm, bn):
    gen = torch.Generator().manual_seed(n + k + m)
    packed, scale, scale_2 = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_W": 2, "WHOLE_K": True}
    y = nvfp4_linear_triton(x, packed, scale, scale_2, out=out, path="gemv", config=cfg)
    assert _rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < TOL[torch.bfloat16]


def test_gemv_two_whole_k_tiles_match_ref():
    """At M = 1 a K whose K / 8 is the sum of two powers of two (32 + 8 words: Flash-Next's 256 + 64, smaller)
    takes two whole-K tiles (the config says so) and equals the reference; the K loop, asked for by a
    config, gives the same values."""
    from ft.kernels.nvfp4.kernel import _gemv_config, whole_k_split

    n, k = 24, 320
    gen = torch.Generator().manual_seed(n + k)
    packed, scale, scale_2 = _weight(n, k, gen)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    assert _gemv_config(1, n, k)["WHOLE_K"] and whole_k_split(1, k) == (32, 8)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16)
    y = nvfp4_linear_triton(x, packed, scale, scale_2, out=out, path="gemv")
    ref = nvfp4_linear_ref(x, packed, scale, scale_2)
    assert _rel_rms(y, ref) < TOL[torch.bfloat16]
    loop = nvfp4_linear_triton(x, packed, scale, scale_2, path="gemv",
                               config={"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_W": 8, "num_warps": 4})
    assert _rel_rms(loop, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dot_swap_ab_matches_ref(dtype):
    gen = torch.Generator().manual_seed(11)
    packed, scale, scale_2 = _weight(72, 160, gen)
    x = torch.randn(5, 160, generator=gen).to(dtype)
    out = torch.full((5, 72), float("nan"), dtype=dtype)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SWAP_AB": True}
    y = nvfp4_linear_triton(x, packed, scale, scale_2, out=out, path="dot", config=cfg)
    assert _rel_rms(y, nvfp4_linear_ref(x, packed, scale, scale_2)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_e2m1_halves_stand_in_is_exact(dtype):
    """The halves decode's plain-Triton stand-in (what the interpreter runs in place of the inline PTX;
    tests/gpu checks the PTX against the same reference): every code byte under scales from E4M3
    subnormals to 448, exactly the reference's dequantized values."""
    from e2m1_halves_probe import run_probe

    got, ref = run_probe(torch.device("cpu"), dtype, asm=False)
    assert torch.equal(got, ref)


def test_e2m1_halves_scaled_stand_in_is_exact():
    """The scaled halves' stand-in (`e2m1_halves_f16_scaled`, the decode attention's form): the
    reference's values times 2**-6, exactly, down to fp16's subnormals."""
    from e2m1_halves_probe import run_probe

    got, ref = run_probe(torch.device("cpu"), torch.float16, asm=False, scaled=True)
    assert got.abs()[got != 0].min() < 2.0 ** -14  # the probe does reach fp16's subnormals
    assert torch.equal(got, ref)


def test_e2m1_word_lanes_stand_in_is_exact():
    """The whole-K tiles' word decode (`e2m1_word_lanes_f32`) in its plain-Triton form: every byte
    value at every byte position of a word, each of its 8 lanes exactly the reference times 2**-6
    (tests/gpu checks the inline PTX against the same reference)."""
    from e2m1_halves_probe import run_lanes_probe

    got, ref = run_lanes_probe(torch.device("cpu"), asm=False)
    assert torch.equal(got, ref) and ref.abs().max() == 6.0 * 2.0 ** -6 and (ref < 0).any()


@pytest.mark.parametrize("m", [3, 8])
def test_dot_halves_match_ref(m):
    """The small-M tile's halves form (x's even / odd columns against the low / high nibbles,
    `Nvfp4Options.dot_halves`, the default at M <= 16 for fp16 and bf16 x when K is whole tiles) against the
    reference and against the interleaved tile, in fp16 (the interpreter's bf16 dot is wrong)."""
    gen = torch.Generator().manual_seed(31 + m)
    packed, scale, scale_2 = _weight(40, 512, gen)
    x = torch.randn(m, 512, generator=gen).to(torch.float16)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1}
    halves = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config={**cfg, "HALVES": True})
    whole = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config={**cfg, "HALVES": False})
    ref = nvfp4_linear_ref(x, packed, scale, scale_2)
    assert _rel_rms(halves, ref) < TOL[torch.float16] and _rel_rms(whole, ref) < TOL[torch.float16]


@pytest.mark.parametrize("m, tile", [(24, (32, 64, 128)), (24, (16, 32, 256)), (40, (64, 32, 256)), (40, (64, 16, 256))],
                         ids=["M24-32x64x128", "M24-16x32x256", "M40-64x32x256", "M40-64x16x256"])
def test_mid_m_tiles_match_ref(m, tile):
    """`_dot_config`'s tiles for 16 < M <= 64 (the wide tile and the narrow one it gives way to when it
    would launch too few programs), halves and interleaved, against the reference in fp16."""
    gen = torch.Generator().manual_seed(7 + m)
    packed, scale, scale_2 = _weight(72, 512, gen)
    x = torch.randn(m, 512, generator=gen).to(torch.float16)
    bm, bn, bk = tile
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1}
    ref = nvfp4_linear_ref(x, packed, scale, scale_2)
    for halves in (True, False):
        y = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config={**cfg, "HALVES": halves})
        assert _rel_rms(y, ref) < TOL[torch.float16], (tile, halves)


@pytest.mark.parametrize("m, splits", [(24, 2), (40, 4), (8, 4)], ids=["M24-split2", "M40-split4", "M8-split4"])
def test_split_k_sums_the_splits_partials_in_order(m, splits):
    """`Nvfp4Options.dot_split_k`: K split over programs (5 K steps of 128: 3 + 2, or 2 + 2 + 1 when 4 are
    asked for), the tile's last program summing the fp32 partials in split order. fp32 x: bit for bit the
    per-split sums of the unsplit kernel over each K slice added in order, then scaled; fp16 x within the
    reference's tolerance; the tickets' counters zero after each launch."""
    from ft.kernels.nvfp4.kernel import dot_launch_config
    from ft.kernels.tickets import ticket_counters

    gen = torch.Generator().manual_seed(50 + m)
    k, bk = 640, 128
    packed, scale, scale_2 = _weight(72, k, gen)
    x = torch.randn(m, k, generator=gen)
    cfg = {"BLOCK_M": 16 if m <= 16 else 32 if m <= 32 else 64, "BLOCK_N": 32, "BLOCK_K": bk, "GROUP_M": 1,
           "SPLIT_K": splits}
    made = dot_launch_config(x, packed, cfg)["SPLIT_K"]
    assert made == (2 if splits == 2 else 3)
    y = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config=cfg)
    assert not ticket_counters(x.device, 1).any()
    step = -(-(k // bk) // made) * bk
    want = None
    for k0 in range(0, k, step):
        part = nvfp4_linear_triton(x[:, k0:k0 + step].contiguous(), packed[:, k0 // 2:(k0 + step) // 2].contiguous(),
                                   scale[:, k0 // 16:(k0 + step) // 16].contiguous(), 1.0, path="dot",
                                   config={**cfg, "SPLIT_K": 1})
        want = part if want is None else want + part
    assert torch.equal(y, want * torch.as_tensor(scale_2, dtype=torch.float32))
    ref = nvfp4_linear_ref(x.half(), packed, scale, scale_2)
    y16 = nvfp4_linear_triton(x.half(), packed, scale, scale_2, path="dot", config=cfg)
    assert _rel_rms(y16, ref) < TOL[torch.float16] and not ticket_counters(x.device, 1).any()


def test_ticket_counters_grow_by_a_new_set_and_keep_the_old():
    """A launch needing more counters gets a new set; the old stays alive (graphs captured before use it)."""
    from ft.kernels import tickets

    dev = torch.device("cpu")
    first = tickets.ticket_counters(dev, 1)
    bigger = tickets.ticket_counters(dev, first.numel() + 1)
    assert bigger.numel() > first.numel() and tickets.ticket_counters(dev, 1) is bigger
    assert any(t is first for t in tickets.ticket_counter_sets(dev))


def test_split_k_is_the_options_at_mid_m_only():
    from ft.kernels.nvfp4.kernel import dot_launch_config
    from ft.kernels.options import use_kernel_options, variant

    packed = torch.zeros(8192, 1024, dtype=torch.uint8)
    with use_kernel_options(variant("nvfp4-dot-split-k-4")):
        assert [dot_launch_config(torch.zeros(m, 2048, dtype=torch.bfloat16), packed)["SPLIT_K"]
                for m in (8, 16, 17, 64, 65)] == [1, 1, 4, 4, 1]
    assert dot_launch_config(torch.zeros(32, 2048, dtype=torch.bfloat16), packed)["SPLIT_K"] == 1  # the default


def test_the_small_m_tile_goes_in_two_warps_past_one_wave(monkeypatch):
    """M <= 16: the 16-row tile in 4 warps while its grid fits one wave of `SMALL_M_WAVE_PROGRAMS_PER_SM` programs an
    SM, in 2 past it (Flash-Next's 16,384-row in_proj_qkvz on 132 SMs: 512 programs); never with a K split, above
    M = 16 or with a config given; off a CUDA device (no SMs to count) always 4."""
    import ft.kernels.nvfp4.kernel as nv
    from ft.kernels.options import use_kernel_options, variant

    def warps(m, n, k=2560, config=None):
        packed = torch.zeros(n, k // 2, dtype=torch.uint8)
        return nv.dot_launch_config(torch.zeros(m, k, dtype=torch.bfloat16), packed, config).get("num_warps")

    assert warps(8, 16384) == 4  # (CPU: no SMs)
    monkeypatch.setattr(nv, "sm_count", lambda device: 132)
    one_wave = 32 * nv.SMALL_M_WAVE_PROGRAMS_PER_SM * 132
    assert [warps(8, n) for n in (12288, one_wave, one_wave + 32, 16384)] == [4, 4, 2, 2]
    assert warps(16, 16384) == 2 and warps(17, 16384) == 4
    assert warps(8, 16384, config=nv._dot_config(8, 16384, 2560)) == 4
    assert warps(8, 2560, 6144) == 4  # out_proj: K split over 4 (`dot_split_k_small_m`)
    with use_kernel_options(variant("nvfp4-dot-small-m-4-warps")):
        assert warps(8, 16384) == 4


def test_dot_config_narrows_the_mid_m_tile_when_it_would_launch_too_few_programs():
    """At 16 < M <= 64: the wide tile where it fills the GPU (in_proj_qkvz, 12,288 rows), the narrow one
    where it would not (out_proj, 2,048 rows: 32 programs of 64 columns)."""
    from ft.kernels.nvfp4.kernel import MID_M_MIN_PROGRAMS, _dot_config

    def tile(m, n):
        c = _dot_config(m, n, 2048)
        return c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]

    assert tile(32, 12288) == (32, 64, 128) and tile(64, 12288) == (64, 32, 256)
    assert tile(32, 2048) == (16, 32, 256) and tile(64, 2048) == (64, 16, 256)
    assert tile(32, 64 * MID_M_MIN_PROGRAMS) == (32, 64, 128) and tile(32, 64 * MID_M_MIN_PROGRAMS - 64) == (16, 32, 256)
    assert all(_dot_config(m, n, 2048)["SPLIT_K"] == 1 for m in (17, 32, 64) for n in (2048, 12288))


def test_a_long_k_on_too_few_tiles_splits_k_instead_of_narrowing():
    """out_proj (2,048 x 4,096): the wide tile with K over `dot_split_k_few_tiles` programs (4); the variant
    "nvfp4-dot-no-split-k" puts the narrow tile back; wide grids never split (M <= 16 has its own option, below)."""
    from ft.kernels.nvfp4.kernel import SPLIT_K_MIN_K, _dot_config
    from ft.kernels.options import use_kernel_options, variant

    def tile(m, n, k):
        c = _dot_config(m, n, k)
        return c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c.get("SPLIT_K", 1)

    assert tile(32, 2048, SPLIT_K_MIN_K) == (32, 64, 128, 4) and tile(64, 2048, 4096) == (64, 32, 256, 4)
    assert tile(32, 12288, 4096) == (32, 64, 128, 1) and tile(8, 12288, 4096)[3] == 1
    with use_kernel_options(variant("nvfp4-dot-no-split-k")):
        assert tile(32, 2048, 4096) == (16, 32, 256, 1) and tile(64, 2048, 4096) == (64, 16, 256, 1)
    with use_kernel_options(variant("nvfp4-dot-split-k-2")):
        assert tile(32, 12288, 2048)[3] == 2 and tile(32, 2048, 4096)[3] == 4


def test_the_16_row_tile_splits_k_on_a_thin_grid_only():
    """`Nvfp4Options.dot_split_k_small_m` (4 by default): at M <= 16 the 16 x 32 tile splits K where its grid has
    fewer than `MID_M_MIN_PROGRAMS` programs and K >= `SPLIT_K_MIN_K` (out_proj 2,048 x 4,096, Flash-Next's
    2,560 x 6,144), never on a wide grid (in_proj_qkvz) or a short K; its variants set the count."""
    from ft.kernels.nvfp4.kernel import MID_M_MIN_PROGRAMS, SPLIT_K_MIN_K, _dot_config
    from ft.kernels.options import use_kernel_options, variant

    def split(m, n, k):
        return _dot_config(m, n, k)["SPLIT_K"]

    with use_kernel_options(variant("nvfp4-dot-no-split-k-small-m")):
        assert [split(8, 2048, 4096), split(8, 2560, 6144), split(16, 2560, 6144)] == [1, 1, 1]
    for name, want in (("nvfp4-dot-split-k-small-m-2", 2), (None, 4)):
        with use_kernel_options(variant(*[name] if name else [])):
            assert [split(m, n, k) for m, n, k in ((8, 2048, 4096), (3, 2560, 6144), (16, 2560, SPLIT_K_MIN_K))] \
                == [want] * 3
            assert split(8, 16384, 4096) == split(8, 2048, SPLIT_K_MIN_K - 256) == 1
            assert split(8, 32 * MID_M_MIN_PROGRAMS, 4096) == 1 and split(8, 32 * MID_M_MIN_PROGRAMS - 32, 4096) == want
            assert split(32, 12288, 2048) == 1  # (the mid-M rule is its own option)


def test_dot_launch_config_takes_the_halves_where_it_can():
    """Which small-M tiles run the halves form: fp16/bf16 x with whole 64-column tiles at M <= 64, not
    fp32 x, a K that is not whole tiles, an odd row stride or M > 64; never the PTX on the CPU."""
    from ft.kernels.nvfp4.kernel import dot_launch_config

    packed = torch.zeros(64, 256, dtype=torch.uint8)
    x = torch.zeros(8, 512, dtype=torch.bfloat16)
    assert dot_launch_config(x, packed)["HALVES"] and not dot_launch_config(x, packed)["ASM"]
    assert dot_launch_config(x.half(), packed)["HALVES"]
    assert not dot_launch_config(x.float(), packed)["HALVES"]
    assert dot_launch_config(torch.zeros(40, 512, dtype=torch.bfloat16), packed)["HALVES"]  # the 64-row tiles too
    assert not dot_launch_config(torch.zeros(80, 512, dtype=torch.bfloat16), packed)["HALVES"]  # prefill's swapped tile
    assert not dot_launch_config(torch.zeros(8, 513, dtype=torch.bfloat16)[:, :512], packed)["HALVES"]  # stride 513
    odd_k = torch.zeros(8, 96, dtype=torch.bfloat16)
    assert not dot_launch_config(odd_k, torch.zeros(64, 48, dtype=torch.uint8))["HALVES"]


def _rows_for_f16(gen: torch.Generator) -> torch.Tensor:
    """bf16 rows of every kind `f16_rows` treats alike or apart: ordinary, huge (past fp16's range), tiny
    (under fp16's normal range), zero, and one holding an inf."""
    x = torch.randn(6, 512, generator=gen)
    x[1] *= 3e6
    x[2] *= 1e-9
    x[3] = 0.0
    x[4, 7] = float("inf")
    return x.to(torch.bfloat16)


def test_f16_rows_match_their_reference_and_lose_nothing_in_range():
    """`f16_rows` (the fp16 operand of `Nvfp4Options.dot_f16_x_max_m`): the values and factors of the torch
    reference bit for bit; each row's largest |x| lands in [2**14, 2**15) (zero and inf rows keep factor
    1), and the row times its factor gives x back exactly wherever x is within 2**-24 of its row's largest."""
    from ft.kernels.nvfp4.f16_rows import F16_ROW_TOP, f16_rows, f16_rows_ref

    x = _rows_for_f16(torch.Generator().manual_seed(5))
    y, s = f16_rows(x)
    y_ref, s_ref = f16_rows_ref(x)
    assert y.dtype == torch.float16 and s.dtype == torch.float32
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
    big = y.float().abs().amax(dim=1)
    for r in (0, 1, 2):
        assert 2.0 ** F16_ROW_TOP <= big[r] < 2.0 ** (F16_ROW_TOP + 1)
    assert s[3] == 1.0 and s[4] == 1.0 and torch.isinf(y[4, 7])
    xf = x.float()
    near = xf.abs() >= xf.abs().amax(dim=1, keepdim=True) * 2.0 ** -24
    back = y.float() * s[:, None]
    assert torch.equal(back[:3][near[:3]], xf[:3][near[:3]])


@pytest.mark.parametrize("m, splits", [(3, 1), (8, 1), (16, 1), (8, 2), (40, 1)], ids=["M3", "M8", "M16", "M8-split2", "M40"])
def test_dot_f16_x_matches_ref_and_the_fp16_tile(monkeypatch, m, splits):
    """`Nvfp4Options.dot_f16_x_max_m` (FLASH_NEXT_F16_ROWS: 64 rows, as Qwen3.8-Flash-Next chooses): a bf16
    x on the halves tile is made fp16 rows (`f16_rows`, called once) and the weights decode scaled
    (`e2m1_halves_f16_scaled`); y stays bf16 and matches the reference; with rows past fp16's range it still
    does, and rows in range give the fp16 tile's y on x made fp16 (the same products, scaled by powers of two)
    bit for bit. No fp16 rows for an fp16 x, under the defaults (None: no model's choice in force), nor with
    variant "nvfp4-dot-bf16-x"."""
    import ft.kernels.nvfp4.kernel as nv
    from ft.kernels.options import use_kernel_options, variant

    calls = []
    real = nv.f16_rows
    monkeypatch.setattr(nv, "f16_rows", lambda x: calls.append(x.shape) or real(x))
    gen = torch.Generator().manual_seed(90 + m)
    packed, scale, scale_2 = _weight(40, 768, gen)
    x = torch.randn(m, 768, generator=gen).to(torch.bfloat16)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1, "SPLIT_K": splits}
    ref = nvfp4_linear_ref(x, packed, scale, scale_2)
    with use_kernel_options(variant(**FLASH_NEXT_F16_ROWS)):
        y = nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config=cfg)
        assert y.dtype == torch.bfloat16 and calls == [(m, 768)]
        assert _rel_rms(y, ref) < TOL[torch.bfloat16]
        y16 = torch.empty_like(y)  # (fp16 x as it is, y rounded once to bf16)
        nvfp4_linear_triton(x.half(), packed, scale, scale_2, path="dot", config=cfg, out=y16)
        assert torch.equal(y, y16)
        huge = x.clone()
        huge[0] *= 1e6  # past fp16's largest value: the row's factor brings it back
        y_huge = nvfp4_linear_triton(huge, packed, scale, scale_2, path="dot", config=cfg)
        assert _rel_rms(y_huge, nvfp4_linear_ref(huge, packed, scale, scale_2)) < TOL[torch.bfloat16]
    calls.clear()
    nvfp4_linear_triton(x.half(), packed, scale, scale_2, path="dot", config=cfg)
    nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config=cfg)  # the defaults: no model's choice
    with use_kernel_options(variant("nvfp4-dot-bf16-x")):
        nvfp4_linear_triton(x, packed, scale, scale_2, path="dot", config=cfg)
    assert calls == []
