"""Qwen3.8-Flash-Next's HyperConnections (ft/model/layers/hyper_connection.py): the stream layout,
the grouped norm, the read's average over gated streams and the write's per-stream gates, checked
where the specification's formulas give a known answer (docs/qwen3.8-flash-next/backbone.md, 2)."""

from __future__ import annotations

import pytest
import torch

from ft.model.layers.hyper_connection import HyperConnection, expand_streams, grouped_rms_norm

C, D, R = 4, 8, 3


def _hc(up_scale=0.3, inject=True, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return HyperConnection(norm=r(C * D) * 0.1, down=r(R, C * D) * 0.3, up=r(C * D, R) * up_scale,
                           inject=r(C, C * D) * 0.3 if inject else None, streams=C)


def test_expand_copies_the_embedding_into_every_stream_stream_major():
    e = torch.arange(2 * D, dtype=torch.float32).reshape(2, D)
    x = expand_streams(e, C)
    assert x.shape == (2, C * D)
    for k in range(C):
        assert torch.equal(x[:, k * D:(k + 1) * D], e)


def test_grouped_norm_normalises_each_stream_on_its_own():
    x = torch.randn(3, C * D)
    x[:, D:2 * D] *= 100.0  # one stream far larger: the others' norms must not see it
    y = grouped_rms_norm(x, torch.zeros(C * D), C, 1e-6).reshape(3, C, D)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3, C), rtol=1e-4, atol=1e-4)
    w = torch.full((C * D,), 0.5)
    torch.testing.assert_close(grouped_rms_norm(x, w, C, 1e-6), 1.5 * y.reshape(3, C * D))


def test_read_of_saturated_gates_is_the_mean_of_the_normalised_streams():
    hc = _hc()
    hc = HyperConnection(norm=hc.norm, down=hc.down, up=torch.zeros_like(hc.up), inject=hc.inject, streams=C)
    x = torch.randn(5, C * D)
    u, gates = hc.read(x)  # W_up = 0: every gate is sigmoid(0) = 1/2
    n = grouped_rms_norm(x, hc.norm, C, hc.eps)
    torch.testing.assert_close(u, 0.5 * n.reshape(5, C, D).mean(1))
    torch.testing.assert_close(gates, n @ hc.inject.T / C)  # the write's gate logits, from the same GEMM


def test_read_of_equal_streams_with_equal_gates_is_one_normalised_stream():
    hc = _hc()
    norm = hc.norm[:D].repeat(C)  # one weight for every stream
    hc = HyperConnection(norm=norm, down=hc.down, up=torch.zeros_like(hc.up), inject=hc.inject, streams=C)
    e = torch.randn(4, D)
    u, _ = hc.read(expand_streams(e, C))
    torch.testing.assert_close(u, 0.5 * grouped_rms_norm(e, norm[:D], 1, hc.eps))


def test_write_adds_the_output_to_every_stream_through_its_own_gate():
    hc = _hc()
    x, y = torch.randn(6, C * D), torch.randn(6, D)
    _, gates = hc.read(x)
    out = hc.write(y, x, gates).reshape(6, C, D)
    n = grouped_rms_norm(x, hc.norm, C, hc.eps)
    a = 2 * torch.sigmoid(n @ hc.inject.T / C)
    for k in range(C):
        torch.testing.assert_close(out[:, k], x.reshape(6, C, D)[:, k] + a[:, k:k + 1] * y)
    zero = HyperConnection(norm=hc.norm, down=hc.down, up=hc.up, inject=torch.zeros_like(hc.inject), streams=C)
    torch.testing.assert_close(zero.write(y, x, zero.read(x)[1]), x + y.repeat(1, C))  # 2 sigmoid(0) = 1


def test_rows_are_independent_tokens():
    hc = _hc(up_scale=1.0)
    x, y = torch.randn(7, C * D), torch.randn(7, D)
    u, gates = hc.read(x)
    u3, gates3 = hc.read(x[3:4])
    torch.testing.assert_close(u[3:4], u3)
    torch.testing.assert_close(hc.write(y, x, gates)[3:4], hc.write(y[3:4], x[3:4], gates3))


def test_the_final_read_has_no_write_and_widths_are_checked():
    hc = _hc(inject=False)
    x = torch.randn(2, C * D)
    u, gates = hc.read(x)
    assert gates is None
    with pytest.raises(ValueError, match="no write"):
        hc.write(u, x, torch.zeros(2, C))
    with pytest.raises(ValueError, match="wide"):
        hc.read(torch.randn(2, C * D + 4))
