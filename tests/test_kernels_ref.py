"""The torch references of ft.kernels against independent formulations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.kernels.attention import paged_attention_ref, write_kv_ref
from ft.kernels.conv1d import causal_conv1d_ref
from ft.kernels.gated_delta import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from ft.kernels.moe import SlotWeights, moe_over_slots_ref
from ft.kernels.nvfp4 import dequantize_nvfp4
from ft.kernels.router import router_topk_ref
from ft.tools.nvfp4_quantize import quantize_nvfp4


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def gdn_inputs(b, t, hk, hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(b, t, hk, dk), r(b, t, hk, dk), r(b, t, hv, dv)
    gate = -F.softplus(r(b, t, hv))  # log decay <= 0
    beta = torch.sigmoid(r(b, t, hv))
    state = r(b, hv, dk, dv) * 0.1
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("t", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["H2-2", "H2-4"])
def test_chunked_gated_delta_equals_recurrent(t, heads):
    q, k, v, g, beta, s0 = gdn_inputs(2, t, heads[0], heads[1], 16, 8)
    o1, s1 = recurrent_gated_delta_rule_ref(q, k, v, g, beta, s0)
    o2, s2 = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=16)
    assert rel(o2, o1) < 1e-5 and rel(s2, s1) < 1e-5


def test_gated_delta_continues_from_state():
    q, k, v, g, beta, s0 = gdn_inputs(1, 50, 2, 4, 16, 8, seed=3)
    o_all, s_all = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0)
    o_a, s_a = chunk_gated_delta_rule_ref(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], s0)
    o_b, s_b = recurrent_gated_delta_rule_ref(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], s_a)
    assert rel(torch.cat([o_a, o_b], 1), o_all) < 1e-5 and rel(s_b, s_all) < 1e-5


def test_causal_conv1d_streams():
    torch.manual_seed(0)
    x, w = torch.randn(2, 23, 12), torch.randn(12, 4)
    state = torch.zeros(2, 12, 3)
    y_all, st_all = causal_conv1d_ref(x, state, w)
    # the definition: zero left padding, depthwise, then SiLU
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), groups=12)).transpose(1, 2)
    assert rel(y_all, ref) < 1e-6
    y1, st = causal_conv1d_ref(x[:, :10], state, w)
    y2, st = causal_conv1d_ref(x[:, 10:11], st, w)
    y3, st = causal_conv1d_ref(x[:, 11:], st, w)
    assert rel(torch.cat([y1, y2, y3], 1), y_all) < 1e-6 and torch.equal(st, st_all)


@pytest.mark.parametrize("start,t", [(0, 37), (21, 1), (40, 9)])
def test_paged_attention_equals_sdpa(start, t):
    torch.manual_seed(1)
    page, hq, hkv, d, n_pages = 8, 4, 2, 16, 12
    k_cache = torch.full((n_pages, page, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.randperm(n_pages)[: -(-(start + t) // page)]
    keys, vals = torch.randn(start + t, hkv, d), torch.randn(start + t, hkv, d)
    write_kv_ref(k_cache, v_cache, keys, vals, table, 0)
    q = torch.randn(t, hq, d)
    out = paged_attention_ref(q, k_cache, v_cache, table, start, d**-0.5)
    kk = keys.repeat_interleave(hq // hkv, 1).transpose(0, 1)
    vv = vals.repeat_interleave(hq // hkv, 1).transpose(0, 1)
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)
    assert rel(out, ref) < 1e-5


def test_router_topk_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = router_topk_ref(logits, 2, normalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, p[:, :2])
    w, _ = router_topk_ref(logits, 2, normalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(1))


def dense_moe(x, ids, weights, w13, w2):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def test_moe_over_slots_dense_and_skip():
    torch.manual_seed(2)
    s, i, h, t, k = 6, 8, 16, 5, 2
    w13, w2 = torch.randn(s, 2 * i, h), torch.randn(s, h, i)
    x = torch.randn(t, h)
    slots = torch.stack([torch.randperm(s)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    ref = dense_moe(x, slots, weights, w13, w2)
    assert rel(moe_over_slots_ref(x, slots, weights, SlotWeights(w13, w2)), ref) < 1e-5
    # pairs marked -1 are skipped: two calls over complementary halves add up to the whole
    first = torch.where(slots < 3, slots, -1)
    second = torch.where(slots >= 3, slots, -1)
    parts = moe_over_slots_ref(x, first, weights, SlotWeights(w13, w2)) + moe_over_slots_ref(
        x, second, weights, SlotWeights(w13, w2)
    )
    assert rel(parts, ref) < 1e-5


def test_moe_over_nvfp4_slots_equals_dequantized():
    torch.manual_seed(3)
    s, i, h, t, k = 4, 16, 32, 3, 2
    gate, up, down = torch.randn(s, i, h), torch.randn(s, i, h), torch.randn(s, h, i)
    q = [[quantize_nvfp4(m[e]) for e in range(s)] for m in (gate, up, down)]
    w = SlotWeights(
        w13=torch.stack([torch.cat([q[0][e][0], q[1][e][0]]) for e in range(s)]),
        w2=torch.stack([q[2][e][0] for e in range(s)]),
        w13_scale=torch.stack([torch.cat([q[0][e][1], q[1][e][1]]) for e in range(s)]),
        w2_scale=torch.stack([q[2][e][1] for e in range(s)]),
        scale_2=torch.stack([torch.stack([q[0][e][2], q[1][e][2], q[2][e][2]]) for e in range(s)]),
    )
    deq = lambda j, e: dequantize_nvfp4(*q[j][e])  # noqa: E731
    w13 = torch.stack([torch.cat([deq(0, e), deq(1, e)]) for e in range(s)])
    w2 = torch.stack([deq(2, e) for e in range(s)])
    x = torch.randn(t, h)
    slots = torch.stack([torch.randperm(s)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    assert rel(moe_over_slots_ref(x, slots, weights, w), dense_moe(x, slots, weights, w13, w2)) < 1e-5
