"""Prefill graphs (`ft.engine.worker.prefill_graphs`) without the graphs, on the CPU: what a replay computes
is a one-sequence prefill padded to a token bucket, with each attention layer's core run on the
real rows between the pieces, reading and writing the static core buffers. Here the padded
prefill runs eagerly through the same path (`_Pieces` below stands in for the capture: it copies
the core's inputs into the buffers and runs the core at once), so these tests check the padding
and the plumbing; the capture and replay themselves are checked on the device
(tests/gpu/test_prefill_graphs_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from ft.engine import SamplingParams
from ft.engine.worker.prefill_graphs import CoreBuffers, PrefillGraphs, prefill_buckets
from test_oracle import make_llm, prompt_of

GREEDY = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)


class _Pieces:
    """`ForwardBatch.pieces` as a replay runs the cores: inputs into the static buffers, the core
    writing the static output's real rows."""

    def __init__(self, batch, buffers: CoreBuffers, rows: int, kv_layer) -> None:
        self.batch, self.buffers, self.rows, self.kv_layer = batch, buffers, rows, kv_layer
        self.cores = 0

    def core(self, fn, kv, q, k, v, gate):
        # a replay hands core i the pool's KV layer i: the cores come in the pool's layer order
        assert [t.data_ptr() for t in kv if t is not None] == \
            [t.data_ptr() for t in self.kv_layer(self.cores) if t is not None]
        bq, bk, bv, bg, out = self.buffers.views(self.rows)
        for dst, src in ((bq, q), (bk, k), (bv, v), (bg, gate)):
            dst.copy_(src)
        fn(self.batch, self.kv_layer(self.cores), bq, bk, bv, bg, out=out)
        self.cores += 1
        return out


class _EagerPrefillGraphs:
    """`PrefillGraphs.run`'s contract, eagerly: the padded batch through `_Pieces` (pieces=True) or
    through the plain padded forward (pieces=False)."""

    def __init__(self, cfg, dtype, max_tokens: int, pieces: bool, max_seqs: int = 1) -> None:
        self.buckets, self.max_seqs = prefill_buckets(max_tokens), max_seqs
        self.buffers = CoreBuffers(self.buckets[-1], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   dtype, torch.device("cpu"))
        self.pieces, self.disabled, self.rows_seen, self.seqs_seen, self.cores = pieces, None, [], [], 0

    bucket = PrefillGraphs.bucket
    rows_for = PrefillGraphs.rows_for

    def run(self, rows, key, batch, forward, kv_layer):
        self.rows_seen.append((rows, int(batch.input_ids.shape[0])))
        self.seqs_seen.append(len(batch.seqs))
        if self.pieces:
            batch.pieces = _Pieces(batch, self.buffers, rows, kv_layer)
        try:
            return forward()
        finally:
            if batch.pieces is not None:
                self.cores += batch.pieces.cores
            batch.pieces = None


def padded_engine(path, pieces: bool, max_tokens: int = 64, max_seqs: int = 1, **opts):
    llm = make_llm(path, **opts)
    runner = llm.engine.runner
    graphs = _EagerPrefillGraphs(llm.engine.model.cfg, llm.engine.model.dtype, max_tokens, pieces, max_seqs)
    runner.prefill_graphs = graphs
    runner._prefill_graph_rows = graphs.rows_for  # the graphs' rule, less the runner's CUDA-only conditions
    return llm, graphs


def first_logits_and_tokens(llm, prompt):
    eng = llm.engine
    seq = eng.add_request(prompt, SamplingParams(**GREEDY))
    while not seq.output_ids:
        eng.step()
    logits = eng.last_logits[0].clone()
    eng.run_until_done([seq])
    return logits, list(seq.output_ids)


@pytest.mark.parametrize("n", [2, 13, 64, 100])
def test_padded_prefill_matches_unpadded(tiny_one, n):
    """A prompt of n tokens prefilled padded to its bucket (64: 13 -> 64 rows; 100 tokens: two
    chunks of 64 and 36 with max_prefill_length 64, the second at start 64) gives the unpadded
    engine's first logits (fp32, within rounding: the row count changes the CPU GEMMs' blocking)
    and its greedy tokens; through the pieces' buffers exactly what the padded forward gives."""
    _, _, path = tiny_one
    prompt = prompt_of(n, seed=n)
    plain = make_llm(path, max_prefill_length=64)
    want_logits, want_tokens = first_logits_and_tokens(plain, prompt)
    got = {}
    for pieces in (False, True):
        llm, graphs = padded_engine(path, pieces, max_prefill_length=64)
        got[pieces] = first_logits_and_tokens(llm, prompt)
        assert graphs.rows_seen and all(rows >= 64 and t == rows for rows, t in graphs.rows_seen), graphs.rows_seen
        if pieces:
            assert graphs.cores == len(llm.engine.model.cfg.full_attention_layers) * len(graphs.rows_seen)
    for logits, tokens in got.values():
        assert torch.allclose(logits, want_logits, rtol=1e-4, atol=1e-4), (logits - want_logits).abs().max()
        assert tokens == want_tokens
    assert torch.equal(got[False][0], got[True][0])


def test_padded_prefill_after_prefix_hit(tiny_one):
    """A prefill that starts after a cached prefix (start > 0, the core reads the cached pages) pads
    like a fresh one and matches the unpadded engine."""
    _, _, path = tiny_one
    shared = prompt_of(48, seed=5)
    prompts = [shared + prompt_of(9, seed=6), shared + prompt_of(20, seed=7)]
    plain = make_llm(path, enable_prefix_cache=True, page_size=16)
    llm, graphs = padded_engine(path, True, enable_prefix_cache=True, page_size=16)
    for p in prompts:
        want = first_logits_and_tokens(plain, p)
        got = first_logits_and_tokens(llm, p)
        assert torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
        assert got[1] == want[1]
    assert any(t < 64 for t in (len(p) - 48 for p in prompts))


def test_padded_prefill_of_several_sequences(tiny_one):
    """Prefills of several sequences in one step (`max_seqs` above 1, as `MAX_SEQS` would allow once
    verified on the device): padded after the last one, each sequence's logits and greedy tokens as
    the unpadded engine's; a step of one token per sequence stays eager."""
    _, _, path = tiny_one
    prompts = [prompt_of(n, seed=20 + n) for n in (9, 23, 30)]
    params = SamplingParams(**GREEDY)

    def run(llm):
        eng = llm.engine
        seqs = [eng.add_request(p, params) for p in prompts]
        eng.step()  # one prefill step for all three (64 tokens fit one chunk budget)
        first = eng.last_logits.clone()
        eng.run_until_done(seqs)
        return first, [list(q.output_ids) for q in seqs]

    want = run(make_llm(path, max_prefill_length=64))
    llm, graphs = padded_engine(path, True, max_seqs=4, max_prefill_length=64)
    got = run(llm)
    assert graphs.seqs_seen and graphs.seqs_seen[0] == 3 and graphs.rows_seen[0] == (64, 64)
    assert torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert got[1] == want[1]


def test_which_prefills_replay():
    """`PrefillGraphs.rows_for`: the bucket of the tokens for up to max_seqs sequences with their last
    logits only; eager (None) for one token per sequence, prompt logprobs (more logit rows), KV
    calibration, a routing trace, too many sequences or tokens, and after a failed capture."""
    from ft.engine.base.step_inputs import StepInputs

    g = PrefillGraphs(256, 4, 2, 8, torch.float32, torch.device("cpu"), max_seqs=2)

    def inp(lengths, **kw):
        ids = [5] * sum(lengths)
        seqs = [(0, n, [0], i) for i, n in enumerate(lengths)]
        logit_index = kw.pop("logit_index", [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))])
        return StepInputs("prefill", ids, list(range(len(ids))), seqs, logit_index, list(range(len(lengths))), **kw)

    assert g.rows_for(inp([2])) == 64 and g.rows_for(inp([40, 30])) == 128 and g.rows_for(inp([256])) == 256
    assert g.rows_for(inp([1])) is None and g.rows_for(inp([1, 1])) is None and g.rows_for(inp([1, 2])) == 64
    assert g.rows_for(inp([3, 3, 3])) is None  # over max_seqs
    assert g.rows_for(inp([257])) is None  # over the largest bucket
    assert g.rows_for(inp([5], logit_index=[0, 1, 2, 3, 4])) is None  # prompt logprobs
    assert g.rows_for(inp([5], calibrate_kv=True)) is None
    assert g.rows_for(inp([5], forced=[0] * 5)) is None
    g.disabled = "a capture failed"
    assert g.rows_for(inp([5])) is None


def test_prefill_buckets():
    assert prefill_buckets(0) == []
    assert prefill_buckets(64) == [64]
    assert prefill_buckets(1000) == [64, 128, 256, 512, 768, 1000]
    assert prefill_buckets(2048)[-3:] == [1024, 1536, 2048]
