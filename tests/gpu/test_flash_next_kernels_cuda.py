"""Qwen3.8-Flash-Next's new kernels compiled for the GPU at its real shapes, against their torch
references: the host-table gather (a pinned table of width 160, 16 heads, 1 and 64 tokens: exact),
QSA's sparse decode attention (24 query heads over 2 KV heads of 256, lists of 2,051 positions: 512
blocks of 4 and a partial block, bf16 / fp8 / NVFP4 caches, batch 1 and 8; a prefill's 512 rows in one
pass), QSA's block scores and
decode selection (4 indexer heads of 128, contexts to 70K tokens of a 256K limit), the
HyperConnection kernels (4 streams of 2,560; the fused read against the cuBLAS read), and the sigmoid-gated RMSNorm (48 value heads of 128).
Beside them the streamed prefill's expert copy (`copy_rows`) at the 80B's NVFP4 expert tensors, and the
slot writes of a padded decode step (`write_slots`) inside a CUDA graph, and the decode-step Engram
(`ngram_rows_decode`, `ple_decode`: the seeds' 16 heads, 4 streams of 2,560, a history of 9) in a graph, and the
prefill's PLE (Triton, and the torch form in chunks) against the torch form in one chunk."""

from __future__ import annotations

import pytest
import torch

from ft.kernels.attention.reference import sparse_decode_attention_ref, write_kv_ref
from ft.kernels.attention.sparse_decode import sparse_decode_attention_triton
from ft.kernels.host_gather import copy_rows, gather_rows
from ft.kernels.host_gather.reference import gather_rows_ref
from ft.kernels.norm import gated_rms_norm
from ft.kernels.norm.reference import gated_rms_norm_ref
from ft.kernels.engram import ngram_rows_decode, ngram_rows_decode_ref, ple_decode, ple_decode_ref
from ft.kernels.slot_write import write_slots, write_slots_ref
from ft.memory.kv_pool import NVFP4_KV, kv_row_size

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {"bf16": 1e-2, "fp8": 1e-2, "nvfp4": 1e-2}
"""Relative RMS of the sparse attention against the fp32 reference on the same (quantized) cache: bf16
queries and tiles, fp32 softmax and sums."""


@pytest.mark.parametrize("tokens", [1, 64])
def test_host_gather_reads_the_pinned_table_exactly(tokens):
    g = torch.Generator().manual_seed(tokens)
    table = torch.randn(100_003, 160, generator=g).to(torch.bfloat16).pin_memory()
    rows = torch.randint(0, table.shape[0], (tokens, 16), generator=g).to(DEV)
    got = gather_rows(table, rows, torch.bfloat16)
    assert got.is_cuda and torch.equal(got.cpu(), gather_rows_ref(table, rows.cpu(), torch.bfloat16))


@pytest.mark.parametrize(("row", "dtype"), [((1024, 1024), torch.uint8), ((1024, 128), torch.float8_e4m3fn),
                                            ((3,), torch.float32)], ids=["w13", "w13-scale", "scale-2"])
def test_copy_rows_moves_pinned_expert_slabs_exactly(row, dtype):
    """A layer's host store of 512 experts (pinned), 37 unsorted ids into a page of 64 slots on a side
    stream: the page's first 37 rows are the experts' bytes, the rest untouched."""
    g = torch.Generator().manual_seed(len(row))
    table = torch.randint(0, 255, (512, *row), dtype=torch.uint8, generator=g).view(dtype).pin_memory() \
        if dtype != torch.float32 else torch.randn(512, *row, generator=g).pin_memory()
    ids = torch.randperm(512, generator=g)[:37]
    page = torch.zeros(64, *row, dtype=dtype, device=DEV)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        copy_rows(page, table, ids.to(DEV))
    side.synchronize()
    as_bytes = (lambda t: t.view(torch.uint8)) if dtype != torch.uint8 else (lambda t: t)
    assert torch.equal(as_bytes(page[:37].cpu()), as_bytes(table[ids]))
    assert not as_bytes(page[37:]).any()


def test_slot_writes_skip_padding_rows_inside_a_graph():
    """The PLE history rows (3 x 10,240 bf16) of a 12-row graph bucket holding 9 sequences, and the
    indexer keys (128 bf16) of a paged pool cut at one layer: replayed, the live rows land, the padding
    rows (slot -1) write nothing, as the reference (the pool's last slot in use by a live row)."""
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor(list(range(8)) + [63] + [-1] * 3, device=DEV)
    history = torch.randn(64, 3, 10240, generator=g).to(torch.bfloat16).to(DEV)
    keys = torch.randn(40, 12, 64, 128, generator=g).to(torch.bfloat16).to(DEV)  # [P, L, page, Di]
    rows_h = torch.randn(12, 3, 10240, device=DEV).to(torch.bfloat16)
    rows_k = torch.randn(12, 128, device=DEV, dtype=torch.float32)
    kslots = torch.tensor([5, 2559, 700, 64, 1000, 3, 2000, 1500, 2558] + [-1] * 3, device=DEV)
    want_h, want_k = history.clone(), keys.clone()
    write_slots_ref(want_h, slots, rows_h)
    write_slots_ref(want_k[:, 7], kslots, rows_k, page_size=64)
    graph = torch.cuda.CUDAGraph()
    got_h, got_k = history.clone(), keys.clone()
    with torch.cuda.graph(graph):
        write_slots(got_h, slots, rows_h)
        write_slots(got_k[:, 7], kslots, rows_k, page_size=64)
    got_h.copy_(history)
    got_k.copy_(keys)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_h, want_h) and torch.equal(got_k, want_k)
    assert torch.equal(want_h[63], rows_h[8])  # the last slot holds its live row, not a padding row's


@pytest.mark.parametrize("batch", [1, 12])
def test_decode_engram_at_the_flagship_shape_inside_a_graph(batch):
    """The hashing (exact, contexts too) and the PLE delta (bf16, within 2e-2 of the fp32 reference on the
    same inputs; the moved histories exact) for `batch` rows, the last of 12 a padding row (slot -1)."""
    from ft.model.layers.engram import EngramHashing

    hs = EngramHashing(ngram_size=3, heads_per_ngram=8, vocab_size_base=1_000_000, eos_token_id=248044)
    g = torch.Generator(device=DEV).manual_seed(batch)
    slots = torch.arange(batch, device=DEV) * 3
    if batch > 1:
        slots[-1] = -1
    ids = torch.randint(0, 248320, (batch,), generator=g, device=DEV)
    contexts = torch.randint(0, 248320, (40, 2), generator=g, device=DEV)
    sizes, offsets = hs.head_tensors(torch.device(DEV))
    c, d, e, hist = 4, 2560, 2560, 9
    x = torch.randn(batch, c * d, generator=g, device=DEV).to(torch.bfloat16)
    kv = (torch.randn(batch, c * d + d, generator=g, device=DEV) * 0.5).to(torch.bfloat16)
    hists = torch.randn(40, hist, c * d, generator=g, device=DEV).to(torch.bfloat16)
    norms = [(torch.randn(c * d, generator=g, device=DEV) * 0.1).to(torch.bfloat16) for _ in range(3)]
    conv = (torch.randn(c * d, 4, generator=g, device=DEV) * 0.3).to(torch.bfloat16)
    want_ctx, want_h = contexts.clone(), hists.clone()
    want_rows = ngram_rows_decode_ref(ids, want_ctx, slots, hs.multipliers, sizes, offsets, 8, 248044)
    want = ple_decode_ref(x.float(), kv.float(), want_h, slots, *[n.float() for n in norms], conv.float(), c, 3, 1e-6)
    got_ctx, got_h = contexts.clone(), hists.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = ngram_rows_decode(ids, got_ctx, slots, hs.multipliers, sizes, offsets, 8, 248044)
        out = ple_decode(x, kv, got_h, slots, *norms, conv, c, 3, 1e-6)
    got_ctx.copy_(contexts)
    got_h.copy_(hists)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows, want_rows) and torch.equal(got_ctx, want_ctx)
    live = slots >= 0
    err = float((out[live].float() - want[live]).norm() / want[live].norm())
    assert err < 2e-2, f"relative RMS {err:.3g}"
    assert float((got_h.float() - want_h.float()).abs().max()) < 0.05  # (the new rows: u_hat from bf16 inputs)
    untouched = torch.ones(40, dtype=torch.bool, device=DEV)
    untouched[slots[live]] = False
    assert torch.equal(got_h[untouched], hists[untouched])  # the padding row wrote no slot


@pytest.mark.parametrize("kv", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("batch", [1, 8])
def test_sparse_decode_attention_at_the_flagship_shape(batch, kv):
    hq, hkv, d, page, ratio, budget = 24, 2, 256, 64, 4, 2048
    g = torch.Generator(device=DEV).manual_seed(batch)
    context = 4096
    cache_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": NVFP4_KV}[kv]
    pages = batch * context // page
    k_cache = torch.zeros(pages, page, hkv, kv_row_size(d, cache_dtype), dtype=cache_dtype, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    scale = None if kv == "bf16" else torch.tensor([0.05, 0.04], device=DEV)
    table = torch.randperm(pages, generator=g, device=DEV).reshape(batch, context // page)
    lists = []
    for b in range(batch):
        k = torch.randn(context, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
        v = torch.randn(context, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
        write_kv_ref(k_cache, v_cache, k, v, table[b], 0, scale)
        blocks = torch.randperm(context // ratio - 1, generator=g, device=DEV)[: budget // ratio]
        chosen = (blocks[:, None] * ratio + torch.arange(ratio, device=DEV)).reshape(-1)
        tail = torch.tensor([context - 4, context - 3, -1], device=DEV)  # the query's incomplete block
        lists.append(torch.cat([chosen, tail]))
    tokens = torch.stack(lists)
    q = torch.randn(batch, hq, d, generator=g, device=DEV).to(torch.bfloat16)
    want = sparse_decode_attention_ref(q.float(), k_cache, v_cache, table, tokens, d ** -0.5, scale)
    got = sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale)
    err = float((got.float() - want).norm() / want.norm())
    assert torch.isfinite(got).all() and err < TOL[kv], f"relative RMS {err:.3g}"
    # gated as QSA's decode passes it: the second half of the q projection's [B, Hq, 2D] rows
    gate = torch.randn(batch, hq, 2 * d, generator=g, device=DEV).to(torch.bfloat16)[..., d:]
    want = sparse_decode_attention_ref(q.float(), k_cache, v_cache, table, tokens, d ** -0.5, scale, gate=gate.float())
    got = sparse_decode_attention_triton(q, k_cache, v_cache, table, tokens, d ** -0.5, scale, gate=gate)
    err = float((got.float() - want).norm() / want.norm())
    assert torch.isfinite(got).all() and err < TOL[kv], f"gated: relative RMS {err:.3g}"


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_sparse_attention_of_a_prefills_rows(kv):
    """A prefill's launch (`QSAAttention._sparse`: 512 queries of one 4K prompt, each its own list of random
    blocks, one split): the one-pass kernel against the reference, and bit for bit the partials through the
    combine (variant "qsa-sparse-combine"), plain and gated."""
    from ft.kernels.options import use_kernel_options, variant

    hq, hkv, d, page, ratio, budget, context, rows = 24, 2, 256, 64, 4, 2048, 4096, 512
    g = torch.Generator(device=DEV).manual_seed(3)
    cache_dtype = {"bf16": torch.bfloat16, "nvfp4": NVFP4_KV}[kv]
    pages = context // page
    k_cache = torch.zeros(pages, page, hkv, kv_row_size(d, cache_dtype), dtype=cache_dtype, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    scale = None if kv == "bf16" else torch.tensor([0.05, 0.04], device=DEV)
    table = torch.randperm(pages, generator=g, device=DEV)[None, :]
    k = torch.randn(context, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(context, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
    write_kv_ref(k_cache, v_cache, k, v, table[0], 0, scale)
    pos = torch.arange(context - rows, context, device=DEV)
    scores = torch.rand(rows, context // ratio, generator=g, device=DEV)
    scores[torch.arange(context // ratio, device=DEV)[None, :] >= (pos // ratio)[:, None]] = -1.0
    chosen = (scores.topk(budget // ratio, dim=1).indices[:, :, None] * ratio + torch.arange(ratio, device=DEV))
    tail = (pos // ratio * ratio)[:, None] + torch.arange(ratio - 1, device=DEV)[None, :]
    tokens = torch.cat([chosen.reshape(rows, -1), torch.where(tail <= pos[:, None], tail, -1)], dim=1)
    tables = table.expand(rows, -1)
    q = torch.randn(rows, hq, d, generator=g, device=DEV).to(torch.bfloat16)
    gate = torch.randn(rows, hq, 2 * d, generator=g, device=DEV).to(torch.bfloat16)[..., d:]
    for gt in (None, gate):
        got = sparse_decode_attention_triton(q, k_cache, v_cache, tables, tokens, d ** -0.5, scale, gate=gt)
        with use_kernel_options(variant("qsa-sparse-combine")):
            two = sparse_decode_attention_triton(q, k_cache, v_cache, tables, tokens, d ** -0.5, scale, gate=gt)
        assert torch.equal(got, two)
        want = sparse_decode_attention_ref(q[:64].float(), k_cache, v_cache, tables[:64], tokens[:64], d ** -0.5,
                                           scale, gate=None if gt is None else gt[:64].float())
        err = float((got[:64].float() - want).norm() / want.norm())
        assert torch.isfinite(got).all() and err < TOL[kv], f"relative RMS {err:.3g}"


def test_sigmoid_gated_norm_at_the_flagship_shape():
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(64, 48, 128, generator=g, device=DEV).to(torch.bfloat16)
    z = torch.randn(64, 48, 128, generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn(128, generator=g, device=DEV) * 0.1 + 1).to(torch.bfloat16)
    got = gated_rms_norm(x, z, w, 1e-6, "sigmoid")
    want = gated_rms_norm_ref(x, z, w, 1e-6, "sigmoid")
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 4e-3


@pytest.mark.parametrize("batch", [1, 8])
def test_block_scores_and_selection_at_the_flagship_shape(batch):
    """QSA's decode selection at the seeds' indexer (4 heads of 128, blocks of 4, a budget of 512
    blocks) over a 262,144-token context limit (65,536 blocks a row): sequences of 9 to 70,001 tokens
    (inside the dense span and far past it) in bf16 raw keys on shuffled pages of 64. The scores
    within 1e-4 of the fp32 reference (-inf past each sequence's blocks), and the selection
    (`_select_kernel`) entry for entry the reference's on the same scores."""
    from ft.kernels.qsa import block_scores_ref, select_decode_tokens_ref
    from ft.kernels.qsa.kernel import block_scores_triton, select_decode_tokens_triton

    hi, di, rot, ratio, page, limit, budget = 4, 128, 64, 4, 64, 262_144, 512
    g = torch.Generator(device=DEV).manual_seed(batch)
    lens = torch.tensor([9, 2_051, 2_052, 4_096, 9_999, 70_001, 33_333, 512][:batch], device=DEV)
    pages_each = (lens + page - 1) // page
    order = torch.randperm(int(pages_each.sum()) + 3, generator=g, device=DEV)
    table = torch.zeros(batch, limit // page, dtype=torch.int64, device=DEV)
    used = 0
    for b, n in enumerate(pages_each.tolist()):
        table[b, :n] = order[used: used + n]
        used += n
    keys = torch.randn(len(order), page, di, generator=g, device=DEV).to(torch.bfloat16)
    q = torch.randn(batch, hi, di, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(di, generator=g, device=DEV) * 0.1
    inv = 1.0 / 1e7 ** (torch.arange(0, rot, 2, device=DEV).float() / rot)
    got = block_scores_triton(q, keys, table, lens, w, 1e-6, inv, 1.0, ratio, limit // ratio)
    want = block_scores_ref(q, keys, table, lens, w, 1e-6, inv, 1.0, ratio, limit // ratio)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)
    tokens = select_decode_tokens_triton(got, lens, budget // ratio, ratio)
    assert torch.equal(tokens, select_decode_tokens_ref(got, lens, budget // ratio, ratio))


@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_hyper_connection_kernels_at_the_flagship_shape(tokens):
    """The HyperConnection kernels at the seeds' 4 streams of 2,560 (bf16) against their references
    computed in fp32 from the same bf16 inputs: the grouped norm, the read's gated mean, the write
    with and without the next read's norm."""
    from ft.kernels.hyper_connection import grouped_rms_norm_ref, hc_mix_ref, hc_write_ref
    from ft.kernels.hyper_connection.kernel import grouped_rms_norm_triton, hc_mix_triton, hc_write_triton

    c, d = 4, 2560
    g = torch.Generator(device=DEV).manual_seed(tokens)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEV) * scale).to(torch.bfloat16)  # noqa: E731
    x, w, logits, n, y = r(tokens, c * d), r(c * d, scale=0.1), r(tokens, c * d, scale=2.0), r(tokens, c * d), \
        r(tokens, d)
    gates, next_w = r(tokens, c, scale=2.0), r(c * d, scale=0.1)

    def close(got, want, what):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"{what}: relative RMS {err:.3g}"

    close(grouped_rms_norm_triton(x, w, c, 1e-6), grouped_rms_norm_ref(x.float(), w.float(), c, 1e-6), "norm")
    close(hc_mix_triton(logits, n, c), hc_mix_ref(logits.float(), n.float(), c), "mix")
    out, nn = hc_write_triton(x, y, gates, c, next_w, 1e-6)
    want, want_nn = hc_write_ref(x.float(), y.float(), gates.float(), c, next_w.float(), 1e-6)
    close(out, want, "write")
    close(nn, want_nn, "next norm")
    assert torch.equal(hc_write_triton(x, y, gates, c), out)


@pytest.mark.parametrize("form", ["fma", "dot", "dot-whole-rank"])
@pytest.mark.parametrize("tokens", [1, 8, 16, 64])
@pytest.mark.parametrize("inject", [True, False], ids=["inject", "final"])
def test_the_fused_hyper_connection_read_at_the_flagship_shape(tokens, inject, form):
    """The fused read (`hc_read_triton`, both forms) at 4 streams of 2,560, rank 320, bf16, against the
    cuBLAS read (`hc_read_ref`: two GEMMs, a SiLU, the mix) and against that read computed in fp32 from
    the same bf16 inputs: within the bf16 path's own distance from fp32."""
    from ft.kernels.hyper_connection import hc_read_ref
    from ft.kernels.hyper_connection.kernel import hc_read_triton

    c, d, rank = 4, 2560, 320
    g = torch.Generator(device=DEV).manual_seed(tokens + 7 * inject)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEV) * scale).to(torch.bfloat16)  # noqa: E731
    n = r(tokens, c * d)
    mix_in, up = r(rank + (c if inject else 0), c * d, scale=0.02), r(c * d, rank, scale=0.1)
    from ft.kernels.options import use_kernel_options, variant

    forms = {"fma": {"hyper_connection.fma_read_max_tokens": 1 << 20},
             "dot": {"hyper_connection.fma_read_max_tokens": 0},
             "dot-whole-rank": {"hyper_connection.fma_read_max_tokens": 0, "hyper_connection.dot_up_block_rank": 512}}
    with use_kernel_options(variant(**forms[form])):
        u, gates = hc_read_triton(n, mix_in, up, rank, c)
    want_u, want_gates = hc_read_ref(n, mix_in, up, rank, c)
    exact_u, exact_gates = hc_read_ref(n.float(), mix_in.float(), up.float(), rank, c)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert u.dtype == want_u.dtype and rel(u, want_u) < 1e-2
    assert rel(u, exact_u) < 2 * rel(want_u, exact_u) + 1e-3
    if inject:
        assert rel(gates, want_gates) < 1e-2 and rel(gates, exact_gates) < 2 * rel(want_gates, exact_gates) + 1e-3
    else:
        assert gates is None
    torch.cuda.synchronize()


def test_the_prefill_ple_on_the_device():
    """The prefill PLE at the seeds' geometry (4 streams of 2,560, 16 x 160 embedding, 4 taps at dilation 3),
    3,000 tokens in three sequences with carried histories: the Triton form (`ple_prefill`) against the model's
    torch form unchunked and in its default chunks (1,092 tokens), all within bf16 closeness (their reductions'
    orders differ), the new histories too; the allocator's peak over the inputs: Triton < chunks < unchunked."""
    import torch.nn.functional as F

    from ft.kernels.engram import ple_prefill, ple_prefill_runs_triton
    from ft.model.layers.engram import PLEWeights, ple_chunk_tokens, ple_delta_batched

    c, d, e, t = 4, 2560, 2560, 3000
    g = torch.Generator(device=DEV).manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV, generator=g) * scale).to(torch.bfloat16)

    w = PLEWeights(key_proj=rand(c * d, e, scale=0.02), value_proj=rand(d, e, scale=0.02), norm_key=rand(c * d, scale=0.1),
                   norm_query=rand(c * d, scale=0.1), norm_conv=rand(c * d, scale=0.1), conv=rand(c * d, 4, scale=0.3),
                   streams=c)
    emb, streams, hist = rand(t, e), rand(t, c, d), rand(3, w.history, c * d)
    x = streams.reshape(t, c * d)
    cu = torch.tensor([0, 5, 1800, t], device=DEV)
    key_value = torch.cat([w.key_proj, w.value_proj])
    assert ple_prefill_runs_triton(x, c)
    forms = {
        "triton": lambda: ple_prefill(x, F.linear(emb, key_value), hist, cu, w.norm_key, w.norm_query, w.norm_conv,
                                      w.conv, c, w.dilation, w.eps),
        "chunks": lambda: ple_delta_batched(emb, streams, w, hist, cu, chunk_tokens=ple_chunk_tokens(c, d)),
        "whole": lambda: ple_delta_batched(emb, streams, w, hist, cu, chunk_tokens=t),
    }
    peaks, outs = {}, {}
    for name, form in forms.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, new = form()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        outs[name] = (out if name == "triton" else x + out, new)
    for name in ("chunks", "whole"):
        torch.testing.assert_close(outs[name][0], outs["triton"][0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(outs[name][1], outs["triton"][1], rtol=2e-2, atol=2e-2)
    assert peaks["triton"] < peaks["chunks"] < peaks["whole"], peaks
