"""The decode step's launch cuts of session 37 on the GPU, each against the launches it replaces, inside
CUDA graphs replayed with new inputs (the counter-based ones must leave their counters at zero for the
next replay, and their last programs must see every other program's stores):

- the decode MoE's pairs summed by its down pass (`moe_decode(sum_counters=...)`, Qwen3.8-Flash-Next's
  expert shape, slot and host reads) against the sum kernel, bit for bit;
- in_proj_ba in the Gated DeltaNet conv launch (`ba_proj`, 48 value heads, hidden 2,560) against its GEMV;
- a HyperConnection write folded into the next read (`hc_write_read`, 4 streams of 2,560, rank 320)
  against the write and the read.
None of these is timed here (bench/decode.py --modes graphs,graphs:VARIANT times the step)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def replay(fn, make_inputs, times: int = 3):
    """fn captured in a CUDA graph on one set of static inputs, then replayed on `times` fresh ones:
    yields (the inputs, the graph's outputs cloned) for each replay."""
    static = make_inputs(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*static)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for i in range(1, times + 1):
        fresh = make_inputs(i)
        for dst, src in zip(static, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        yield fresh, tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)


def _pool(slots: int, hidden: int, inter: int, device=DEV):
    """Random NVFP4 experts [slots, ...] (every byte a valid pair of codes), block scales ~ 2^U(-3, 3)."""
    from ft.kernels.moe import SlotWeights

    def part(n, k):
        packed = torch.randint(0, 256, (slots, n, k // 2), dtype=torch.uint8)
        scale = torch.exp2(torch.empty(slots, n, k // 16).uniform_(-3, 3)).to(torch.float8_e4m3fn)
        return packed, scale

    w13, s13 = part(2 * inter, hidden)
    w2, s2w = part(hidden, inter)
    pool = SlotWeights(w13, w2, s13, s2w, torch.empty(slots, 3).uniform_(0.005, 0.02))
    return SlotWeights(*(t.to(device) for t in pool)) if device == DEV else SlotWeights(*(t.pin_memory() for t in pool))


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("host", [False, True], ids=["slots", "host-reads"])
def test_the_down_pass_sums_the_pairs_inside_a_graph(tokens, host):
    """Qwen3.8-Flash-Next's expert shape (hidden 2,560, width 640), top-10 + the shared expert: y with the
    down pass's own sum equals the sum kernel's bit for bit, on every replay, padding rows included."""
    from ft.kernels.moe import SlotWeights, sum_counters_needed
    from ft.kernels.moe.decode_kernel import moe_decode_triton

    torch.manual_seed(tokens)
    hidden, inter, slots, k = 2560, 640, 64, 10
    pool = _pool(slots, hidden, inter)
    shared = SlotWeights(*(t[:1].clone() for t in pool))
    store = SlotWeights(*(t[None] for t in _pool(slots, hidden, inter, device="cpu"))) if host else None
    counters = torch.zeros(sum_counters_needed(tokens, hidden), dtype=torch.int32, device=DEV)
    live = torch.arange(tokens, device=DEV)
    live[-1] = -1 if tokens > 1 else 0  # the last row padding (at 8 tokens)

    def inputs(i):
        gi = torch.Generator(device=DEV).manual_seed(i)
        x = torch.randn(tokens, hidden, device=DEV, generator=gi).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(slots, device=DEV, generator=gi)[:k] for _ in range(tokens)])
        slots_ = torch.where(torch.rand(tokens, k, device=DEV, generator=gi) < 0.5, -1, ids) if host else ids
        wts = torch.cat([torch.softmax(torch.randn(tokens, k, device=DEV, generator=gi), -1),
                         torch.rand(tokens, 1, device=DEV, generator=gi)], 1).to(torch.bfloat16)
        return x, slots_, ids, wts

    def call(x, slots_, ids, wts, counters_=None):
        extra = {"host": store, "topk_ids": ids, "layer": 0} if host else {}
        return (moe_decode_triton(x, slots_, wts, pool, shared, live=live, sum_counters=counters_, **extra),)

    for (x, slots_, ids, wts), got in replay(lambda *a: call(*a, counters_=counters), inputs):
        assert torch.equal(got[0], call(x, slots_, ids, wts)[0]) and not counters.any()


@pytest.mark.parametrize("batch", [1, 8])
def test_in_proj_ba_in_the_conv_launch(batch):
    """Qwen3.8-Flash-Next's Gated DeltaNet (16 key heads, 48 value heads of 128, conv width 4, hidden
    2,560): b, a computed in the conv launch against in_proj_ba's own GEMV given to the same kernels,
    from the same states."""
    from ft.kernels.dense import dense_linear
    from ft.kernels.gated_delta.kernel import gated_delta_decode_triton

    torch.manual_seed(batch)
    hk, hv, dk, dv, width, hidden, pool_slots = 16, 48, 128, 128, 4, 2560, 12
    c = 2 * hk * dk + hv * dv
    conv_weight = (torch.randn(c, width, device=DEV) * 0.3).to(torch.bfloat16)
    a_log = (torch.rand(hv, device=DEV) * 15 + 1).log().to(torch.bfloat16)
    dt_bias = (torch.randn(hv, device=DEV) * 0.5).to(torch.bfloat16)
    w_ba = (torch.randn(2 * hv, hidden, device=DEV) * hidden ** -0.5).to(torch.bfloat16)
    conv0 = torch.randn(pool_slots, c, width - 1, device=DEV).to(torch.bfloat16)
    ssm0 = torch.randn(pool_slots, hv, dk, dv, device=DEV) * 0.3
    slots = torch.randperm(pool_slots, device=DEV)[:batch]
    mixed = torch.randn(batch, c, device=DEV).to(torch.bfloat16)
    h = torch.randn(batch, hidden, device=DEV).to(torch.bfloat16)
    conv, ssm = conv0.clone(), ssm0.clone()
    got = gated_delta_decode_triton(mixed, None, None, conv, ssm, conv_weight, a_log, dt_bias, slots, ba_proj=(h, w_ba))
    conv2, ssm2 = conv0.clone(), ssm0.clone()
    ba = dense_linear(h, w_ba)
    want = gated_delta_decode_triton(mixed, ba[:, :hv], ba[:, hv:], conv2, ssm2, conv_weight, a_log, dt_bias, slots)
    assert rel(got, want) < 1e-2 and rel(ssm[slots], ssm2[slots]) < 1e-3
    assert torch.equal(conv, conv2)  # the conv state is a shifted copy either way


@pytest.mark.parametrize("inject", [True, False], ids=["inject", "final"])
def test_a_write_folded_into_the_next_read_at_the_flagship_shape(inject):
    """4 streams of 2,560, rank 320, bf16, one token: `hc_write_read_triton` (two launches, the norm's 1 / rms
    applied in the second, the up tile's rank as 256 + 64) against the write with the next norm
    then the fused read (three launches): the new state bit for bit where the norm does not enter it, the
    block input and gate logits within the bf16 read's own error."""
    from ft.kernels.hyper_connection.kernel import hc_read_triton, hc_write_read_triton, hc_write_triton

    c, d, rank = 4, 2560, 320
    g = torch.Generator(device=DEV).manual_seed(int(inject))
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEV) * scale).to(torch.bfloat16)  # noqa: E731
    x, y, gates, next_norm = r(1, c * d, scale=3.0), r(1, d), r(1, c, scale=2.0), r(c * d, scale=0.1)
    mix_in, up = r(rank + (c if inject else 0), c * d, scale=0.02), r(c * d, rank, scale=0.1)
    out, u, next_gates = hc_write_read_triton(x, y, gates, c, next_norm, 1e-6, mix_in, up, rank)
    want_out, n = hc_write_triton(x, y, gates, c, next_norm, 1e-6)
    want_u, want_gates = hc_read_triton(n, mix_in, up, rank, c)
    assert torch.equal(out, want_out)
    assert rel(u, want_u) < 1e-2
    assert (next_gates is None) == (not inject) and (not inject or rel(next_gates, want_gates) < 1e-2)


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_indexer_keys_written_with_k_and_v(kv):
    """QSA's raw indexer keys (128 a token, bf16) written by the K/V write's launch (`extra`) at a padded
    decode step's slots: the same bytes as `write_slots` after the plain K/V write, K and V unchanged."""
    from ft.kernels.attention.kernel import write_kv_decode_triton
    from ft.kernels.slot_write import write_slots
    from ft.memory.kv_pool import NVFP4_KV, kv_row_size

    torch.manual_seed(0)
    pages, page, hkv, d, b = 40, 16, 2, 256, 8
    dtype = torch.uint8 if kv == "nvfp4" else torch.bfloat16
    row = kv_row_size(d, NVFP4_KV) if kv == "nvfp4" else d
    k_cache = torch.zeros(pages, page, hkv, row, dtype=dtype, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    scale = torch.tensor([0.05, 0.07], device=DEV) if kv == "nvfp4" else None
    k, v = (torch.randn(b, hkv, d, device=DEV).to(torch.bfloat16) for _ in range(2))
    raw = torch.randn(b, 128, device=DEV).to(torch.bfloat16)
    slots = torch.randperm(pages * page, device=DEV)[:b]
    slots[3] = -1
    index = torch.zeros(pages, page, 128, dtype=torch.bfloat16, device=DEV)
    k2, v2, index2 = k_cache.clone(), v_cache.clone(), index.clone()
    write_kv_decode_triton(k_cache, v_cache, k, v, slots, scale, extra=(index, raw))
    write_kv_decode_triton(k2, v2, k, v, slots, scale)
    write_slots(index2, slots, raw, page_size=page)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2) and torch.equal(index, index2)
