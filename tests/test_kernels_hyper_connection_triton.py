"""The HyperConnection kernels (`ft.kernels.hyper_connection`) against their torch references under the
interpreter (fp32, fp16; small shapes: 2 and 4 streams, stream widths 16 and 40, which is not a power
of two, 1 and 5 tokens, a row stride wider than the row), and a HyperConnection's read and write
through the kernels against the same module's torch path, the write's fused next norm included; the
fused read (`hc_read_triton`: its down kernel's partial sums over several chunks and a partial last row
tile, the up kernel's columns over several programs) against `hc_read_ref`, with and without the
inject rows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.hyper_connection import grouped_rms_norm_ref, hc_mix_ref, hc_read_ref, hc_write_ref
from ft.kernels.hyper_connection import kernel as details
from ft.kernels.options import use_kernel_options, variant
from ft.model.layers.hyper_connection import HyperConnection

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
"""Relative RMS against the reference: fp32 differs in the order of the sums only; fp16 also where a
sum's fp32 order moves a rounding."""
SHAPES = [(1, 2, 16), (5, 4, 40), (3, 4, 16)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def wide(t: torch.Tensor) -> torch.Tensor:
    """t [T, W] as a view with a row stride of W + 3 (the kernels take any row stride)."""
    out = torch.full((t.shape[0], t.shape[1] + 3), float("nan"), dtype=t.dtype)
    out[:, : t.shape[1]] = t
    return out[:, : t.shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,c,d", SHAPES, ids=[f"T{t}-C{c}-D{d}" for t, c, d in SHAPES])
def test_kernels_equal_the_references(t, c, d, dtype):
    g = torch.Generator().manual_seed(t * 100 + c * 10 + d)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    x, w = wide(r(t, c * d)), r(c * d, scale=0.1)
    x[:, :d] *= 30.0  # one stream far larger: the norm is per stream
    got = details.grouped_rms_norm_triton(x, w, c, 1e-6)
    assert rel(got, grouped_rms_norm_ref(x, w, c, 1e-6)) < TOL[dtype]

    logits, n = wide(r(t, c * d, scale=2.0)), r(t, c * d)
    u = details.hc_mix_triton(logits, n, c)
    assert u.shape == (t, d) and rel(u, hc_mix_ref(logits, n, c)) < TOL[dtype]

    y, gates, next_w = r(t, d), wide(r(t, c, scale=2.0)), r(c * d, scale=0.1)
    out = details.hc_write_triton(x, y, gates, c)
    assert rel(out, hc_write_ref(x, y, gates, c)) < TOL[dtype]
    out2, n2 = details.hc_write_triton(x, y, gates, c, next_w, 1e-6)
    want2, want_n2 = hc_write_ref(x, y, gates, c, next_w, 1e-6)
    assert torch.equal(out2, out) and rel(out2, want2) < TOL[dtype] and rel(n2, want_n2) < TOL[dtype]


def test_the_write_gates_each_stream_by_its_own_logit():
    """A write whose gate logits differ per stream: stream k adds 2 sigmoid(logit_k) y; a kernel that
    mixed up the streams or the rows fails."""
    c, d = 4, 16
    logits = torch.tensor([[-0.4, 0.0, 0.3, 1.2], [0.5, -1.0, 0.0, 2.0]])
    x, y = torch.zeros(2, c * d), torch.ones(2, d)
    out = details.hc_write_triton(x, y, logits, c).reshape(2, c, d)
    torch.testing.assert_close(out[:, :, 0], 2.0 * torch.sigmoid(logits))
    assert len(set(out[0, :, 0].tolist())) == c


FORM = {"fma": {"hyper_connection.fma_read_max_tokens": 1 << 20},
        "dot": {"hyper_connection.fma_read_max_tokens": 0, "hyper_connection.dot_up_block_rank": 32},
        "dot-whole-rank": {"hyper_connection.fma_read_max_tokens": 0, "hyper_connection.dot_up_block_rank": 1 << 10}}
"""Options that send every fused read to one form (the fma form's up tile takes a rank that is no power of two in
two pieces: 6 = 4 + 2, 20 = 16 + 4, 5 = 4 + 1, 70 = 64 + 6 in 8; 8 whole; the dot form in rank steps of 32:
rank 70 takes three; or the whole rank in one step)."""
SMALL_TILES = {"hyper_connection.down_chunk": 32, "hyper_connection.down_rows": 4, "hyper_connection.up_block_d": 8,
               "hyper_connection.dot_down_chunk": 32, "hyper_connection.dot_down_block_k": 16,
               "hyper_connection.dot_up_block_d": 4}
"""Tiles small enough that the test shapes take several chunks, row tiles and column programs."""
READS = [(1, 4, 16, 6, True), (5, 4, 40, 20, True), (3, 2, 24, 5, False), (2, 4, 16, 3, False),
         (17, 4, 16, 70, True), (1, 4, 16, 8, True)]
"""(tokens, streams, D, rank, inject rows): 17 tokens pad to 32 rows in the "dot" form, rank 70 takes
two of its rank steps."""


@pytest.mark.parametrize("form", ["fma", "dot", "dot-whole-rank"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,c,d,rank,inject", READS, ids=[f"T{t}-C{c}-D{d}-r{r}-{'inject' if i else 'final'}"
                                                          for t, c, d, r, i in READS])
def test_the_fused_read_equals_the_reference(t, c, d, rank, inject, dtype, form):
    g = torch.Generator().manual_seed(t * 1000 + d * 10 + rank)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    n = wide(r(t, c * d))
    mix_in = r(rank + (c if inject else 0), c * d, scale=0.3)
    up = r(c * d, rank, scale=0.5)
    with use_kernel_options(variant(**SMALL_TILES, **FORM[form])):
        u, gates = details.hc_read_triton(n, mix_in, up, rank, c)
    want_u, want_gates = hc_read_ref(n, mix_in, up, rank, c)
    assert u.shape == (t, d) and u.dtype == want_u.dtype and rel(u, want_u) < TOL[dtype]
    if inject:
        assert gates.shape == (t, c) and rel(gates, want_gates) < TOL[dtype]
    else:
        assert gates is None


def module(r, c: int, d: int, rank: int) -> HyperConnection:
    """A HyperConnection of C streams of D, rank `rank`, with an inject, its tensors drawn by r(*shape, scale=)."""
    return HyperConnection(r(c * d, scale=0.1), r(rank, c * d, scale=0.3), r(c * d, rank, scale=0.3),
                           r(c, c * d, scale=0.3), c)


@pytest.mark.parametrize("fused", [None, "fma", "dot"], ids=["cublas-read", "fused-fma", "fused-dot"])
def test_a_read_and_fused_write_through_the_kernels_equal_the_torch_path(monkeypatch, fused):
    """`HyperConnection.read` / `write(next_hc=...)` with the Triton kernels (dispatched as on a GPU) against
    the same calls on the references: the state, the block input and the next read's input; with the
    fused read on, the read goes through `hc_read_triton` (counted)."""
    import ft.kernels.hyper_connection as hcmod

    c, d, r_ = 4, 40, 6
    g = torch.Generator().manual_seed(3)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    first, second = module(r, c, d, r_), module(r, c, d, r_)
    x, y = r(5, c * d), r(5, d)

    def run():
        u, gates = first.read(x)
        x2, n2 = first.write(y, x, gates, next_hc=second)
        return u, x2, second.read(x2, n2)[0]

    monkeypatch.setattr(hcmod, "uses_triton", lambda device: False)
    want = run()
    monkeypatch.setattr(hcmod, "uses_triton", lambda device: True)
    calls = []
    fused_read = details.hc_read_triton
    monkeypatch.setattr(details, "hc_read_triton", lambda *a: calls.append(1) or fused_read(*a))
    with use_kernel_options(variant(**SMALL_TILES, **FORM[fused or "fma"],
                                    **{"hyper_connection.fused_read_max_tokens": 8 if fused else 0})):
        got = run()
    assert len(calls) == (2 if fused else 0)
    for a, b in zip(got, want):
        assert rel(a, b) < TOL[torch.float32]


WRITE_READS = [(1, 4, 16, 6, True), (1, 4, 40, 20, False), (2, 2, 24, 5, True), (3, 4, 40, 9, True)]
"""(tokens, streams, D, rank, inject rows of the next read): with 32-column chunks a chunk spans two streams
where D is 24 or 40 (not a power of two: masked)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,c,d,rank,inject", WRITE_READS, ids=[f"T{t}-C{c}-D{d}-r{r}-{'inject' if i else 'final'}"
                                                                 for t, c, d, r, i in WRITE_READS])
def test_a_write_folded_into_the_next_read_equals_the_two(t, c, d, rank, inject, dtype):
    """`hc_write_read_triton` (the write inside the read's first launch) against `hc_write_read_ref` (the
    write with the next norm, then the read): the new state, the next block's input and gate logits; the norm
    deferred to the second launch (chunks cut at the streams' bounds: 32 columns of a stream of 40, a last
    chunk of 8; one chunk of 24 in 32 lanes), the ranks (none a power of two) in two pieces; the new state bit
    for bit in fp16."""
    from ft.kernels.hyper_connection import hc_write_read_ref

    g = torch.Generator().manual_seed(t * 100 + d + rank)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    x, y, gates = wide(r(t, c * d)), r(t, d), wide(r(t, c, scale=2.0))
    x[:, :d] *= 20.0  # streams of different scales: each its own norm
    next_norm = r(c * d, scale=0.1)
    mix_in, up_w = r(rank + (c if inject else 0), c * d, scale=0.3), r(c * d, rank, scale=0.5)
    with use_kernel_options(variant(**SMALL_TILES)):
        got = details.hc_write_read_triton(x, y, gates, c, next_norm, 1e-6, mix_in, up_w, rank)
    want = hc_write_read_ref(x, y, gates, c, next_norm, 1e-6, mix_in, up_w, rank)
    assert got[0].shape == want[0].shape and rel(got[0], want[0]) < TOL[dtype]
    if dtype == torch.float16:  # (in fp32 the interpreter's sigmoid is not torch's to the last bit)
        assert torch.equal(got[0], want[0])
    assert got[1].shape == (t, d) and got[1].dtype == want[1].dtype and rel(got[1], want[1]) < TOL[dtype]
    if inject:
        assert got[2].shape == (t, c) and rel(got[2], want[2]) < TOL[dtype]
    else:
        assert got[2] is None and want[2] is None


def test_write_read_dispatches_one_token_to_the_folded_launches(monkeypatch):
    """`HyperConnection.write_read` at one token goes through `hc_write_read_triton` (on Triton, option on),
    at two tokens or with variant "hc-write-own-launch" through the write and the read; all equal the
    torch path."""
    import ft.kernels.hyper_connection as hcmod

    c, d, r_ = 4, 40, 6
    g = torch.Generator().manual_seed(9)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    first, second = module(r, c, d, r_), module(r, c, d, r_)
    calls = []
    folded = details.hc_write_read_triton
    monkeypatch.setattr(details, "hc_write_read_triton", lambda *a: calls.append(a[0].shape[0]) or folded(*a))
    for tokens, names, n_calls in ((1, (), 1), (2, (), 1), (1, ("hc-write-own-launch",), 1)):
        x, y, gates = r(tokens, c * d), r(tokens, d), r(tokens, c)
        monkeypatch.setattr(hcmod, "uses_triton", lambda device: False)
        want = first.write_read(y, x, gates, second)
        monkeypatch.setattr(hcmod, "uses_triton", lambda device: True)
        with use_kernel_options(variant(*names, **SMALL_TILES)):
            got = first.write_read(y, x, gates, second)
        assert len(calls) == n_calls
        for a, b in zip(got, want):
            assert rel(a, b) < TOL[torch.float32]
