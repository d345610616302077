"""The model runner: persistent buffers with fixed addresses, the same logits as a batch built by
hand, seeded sampling that does not depend on the rest of the batch."""

from __future__ import annotations

import math

import torch

from ft.engine import SamplingParams
from ft.engine.worker.model_runner import ModelRunner
from ft.model.forward_batch import ForwardBatch, SeqSlice
from test_oracle import make_llm, prompt_of


def sized_runner(eng, **sizes) -> ModelRunner:
    cfg = eng.config
    opts = dict(max_running_requests=cfg.max_running_requests, max_prefill_length=cfg.max_prefill_length,
                max_pages_per_seq=math.ceil(eng.context_limit / cfg.page_size))
    return ModelRunner(eng.model, eng.pools, eng.device, **{**opts, **sizes})


class HandBuiltRunner(ModelRunner):
    """The batch as it was built before the buffers: fresh tensors from Python lists each step."""

    def prepare(self, work):
        ids, pos, slices = [], [], []
        for seq, n in zip(work.seqs, work.num_tokens):
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slices.append(SeqSlice(start, n, torch.tensor(seq.pages, dtype=torch.int64, device=self.device),
                                   seq.mamba_slot))
        return ForwardBatch(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), slices)


def addresses(runner: ModelRunner) -> dict[str, int]:
    out = {name: b.device_buffer.data_ptr() for name, b in runner.buffers.items()}
    out |= {"decode " + name: b.device_buffer.data_ptr() for name, b in runner.decode_buffers.items()}
    return {**out, "page_table": runner.page_table.table.data_ptr()}


def staggered_requests(eng) -> list:
    """Requests that join and leave at different steps: batches of 1, 2 and 3 sequences."""
    return [
        (0, prompt_of(40, seed=1), SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)),
        (2, prompt_of(23, seed=2), SamplingParams(max_new_tokens=5, temperature=0.9, top_k=20, seed=7, ignore_eos=True)),
        (3, prompt_of(9, seed=3), SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.8, ignore_eos=True, seed=3)),
    ]


def run_staggered(eng) -> tuple[list[torch.Tensor], list[list[int]]]:
    logits, seqs, step = [], [], 0
    pending = staggered_requests(eng)
    while pending or eng.has_work:
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            seqs.append(eng.add_request(prompt, params))
        eng.step()
        logits.append(eng.last_logits.clone())
        step += 1
    return logits, [s.output_ids for s in seqs]


def test_buffers_keep_their_addresses(tiny_one):
    eng = make_llm(tiny_one[2], max_prefill_length=32).engine
    eng.runner = runner = sized_runner(eng)
    before = addresses(runner)
    logits, _ = run_staggered(eng)
    assert {t.shape[0] for t in logits} == {1, 2, 3}  # batch sizes varied
    assert addresses(runner) == before
    # the batch the model reads is made of views of the buffers
    seq = eng.add_request(prompt_of(5), SamplingParams(max_new_tokens=1))
    batch = runner.prepare(eng.scheduler.schedule())
    assert batch.input_ids.data_ptr() == runner.buffers["input_ids"].device_buffer.data_ptr()
    assert batch.positions.data_ptr() == runner.buffers["positions"].device_buffer.data_ptr()
    assert batch.mamba_slots.data_ptr() == runner.buffers["mamba_slots"].device_buffer.data_ptr()
    assert batch.seqs[0].page_table.data_ptr() == runner.page_table.table.data_ptr()
    assert batch.seqs[0].page_table.tolist() == seq.pages and batch.mamba_slots.tolist() == [seq.mamba_slot]


def test_a_decode_step_loads_its_inputs_in_one_copy(tiny_one):
    """A decode step's inputs (ids, positions, KV slots, lengths, logit rows, mamba slots, the page
    table's rows) are regions of one arena: one flush per decode step, none for a prefill, and the
    batch reads its views, holding the step's values."""
    eng = make_llm(tiny_one[2], max_prefill_length=32).engine
    eng.runner = runner = sized_runner(eng)
    arena = runner.decode_arena
    seen = []  # (kind, flushes after the load, the batch, the inputs)
    load = runner.load

    def recording_load(inp):
        batch = load(inp)
        seen.append((inp.kind, arena.flushes, batch, inp))
        return batch

    runner.load = recording_load
    for n in (7, 12):
        eng.add_request(prompt_of(n, seed=n), SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    while eng.has_work:
        eng.step()
    kinds = [k for k, _, _, _ in seen]
    assert "prefill" in kinds and kinds.count("decode") >= 4
    flushes = 0
    block = arena.device_block
    lo, hi = block.data_ptr(), block.data_ptr() + block.numel()
    for kind, after, batch, inp in seen:
        flushes += kind == "decode"
        assert after == flushes
        if kind != "decode":
            continue
        for t in (batch.input_ids, batch.positions, batch.mamba_slots, batch.last_token_index, batch.decode.seq_lens,
                  batch.decode.slot_mapping):
            assert lo <= t.data_ptr() < hi
        if batch is seen[-1][2]:  # the views hold the last step's values (earlier ones were overwritten)
            assert batch.input_ids.tolist() == inp.ids and batch.positions.tolist() == inp.pos
            assert batch.decode.seq_lens.tolist() == inp.seq_lens and batch.decode.slot_mapping.tolist() == inp.kv_slots
            assert batch.mamba_slots.tolist() == inp.mamba_slots
            for i, (_, _, pages, _) in enumerate(inp.seqs):
                assert batch.seqs[i].page_table[: len(pages)].tolist() == pages


def test_buffers_grow_only_when_a_batch_exceeds_them(tiny_one):
    eng = make_llm(tiny_one[2], max_prefill_length=32).engine
    eng.runner = runner = sized_runner(eng, max_running_requests=1, max_prefill_length=1, max_pages_per_seq=1)
    run_staggered(eng)  # grows to the largest batch seen
    grown = addresses(runner)
    assert runner.buffers["input_ids"].capacity >= 32 and runner.page_table.rows >= 3
    run_staggered(eng)
    assert addresses(runner) == grown


def test_runner_matches_a_hand_built_batch(tiny_one):
    """Bitwise the same logits and tokens: with the sized buffers, with the engine's own runner
    (grown from its constructor sizes), and with the batch built by hand each step."""
    engines = [make_llm(tiny_one[2], max_prefill_length=32).engine for _ in range(3)]
    engines[1].runner = sized_runner(engines[1])
    e = engines[2]
    e.runner = HandBuiltRunner(e.model, e.pools, e.device)
    (la, ta), (lb, tb), (lc, tc) = (run_staggered(e) for e in engines)
    assert ta == tb == tc and all(len(t) for t in ta)
    assert len(la) == len(lb) == len(lc)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(la, lb, lc))


def test_seeded_request_same_tokens_in_any_batch(tiny_one):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = prompt_of(30, seed=5)

    def tokens(others: int) -> list[int]:
        eng = make_llm(tiny_one[2]).engine
        seq = eng.add_request(prompt, params)
        for i in range(others):
            eng.add_request(prompt_of(17 + 5 * i, seed=10 + i), SamplingParams(max_new_tokens=6, temperature=0.7, seed=i))
        eng.run_until_done([seq])
        return seq.output_ids

    alone = tokens(0)
    assert tokens(2) == alone == tokens(0)
    other_seed = make_llm(tiny_one[2]).engine
    seq = other_seed.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": 99}))
    other_seed.run_until_done([seq])
    assert seq.output_ids != alone


def test_decode_graph_buckets():
    from ft.engine.worker.decode_graphs import DecodeGraphs, batch_buckets

    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert batch_buckets(100) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert batch_buckets(12) == [1, 2, 4, 8, 12] and batch_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    g = DecodeGraphs(40)
    assert [g.bucket(b) for b in (1, 3, 9, 13, 33, 40, 41)] == [1, 4, 12, 16, 40, 40, None]
    assert batch_buckets(16, (1, 2, 4, 6, 8, 10, 12, 14, 16, 32)) == [1, 2, 4, 6, 8, 10, 12, 14, 16]
    g = DecodeGraphs(16, sizes=(1, 2, 4, 6, 8, 10))  # --cuda-graph-bs: its sizes, eager past the largest
    assert [g.bucket(b) for b in (3, 5, 9, 10, 11)] == [4, 6, 10, 10, None]
    assert g.graph(1) is None  # nothing captured yet (a capture needs CUDA: tests/gpu)


def test_a_mixed_step_runs_its_decoding_rows_as_one_decode_attention(tiny_one, monkeypatch):
    """A step that prefills a prompt beside running decodes hands its leading one-token rows to the attention
    layers as decode tensors (`ForwardBatch.decode_rows`: the rows' KV slots and lengths, the page table's
    first rows), which run them through one decode attention; the prompt alone takes the prefill attention.
    The Gated DeltaNet layers take the rows as one recurrent step (the decode kernels) and the prompt alone as
    a packed prefill. The logits and tokens are those of the per-sequence prefill path (`_decode_rows` off),
    to fp32 rounding."""
    from ft.model.layers import attention, gated_deltanet

    def run(rows_on: bool):
        eng = make_llm(tiny_one[2]).engine
        if not rows_on:
            monkeypatch.setattr(eng.runner, "_decode_rows", lambda inp: None)
        seen = []
        real_core = attention.GatedAttention._prefill_core
        monkeypatch.setattr(attention.GatedAttention, "_prefill_core",
                            lambda self, batch, *a, **kw: seen.append((batch.decode_rows, len(batch.seqs)))
                            or real_core(self, batch, *a, **kw))
        linear = []  # per Gated DeltaNet call of a step: ("decode", rows) or ("prefill", sequences)
        real_decode, real_conv = gated_deltanet.gated_delta_decode, gated_deltanet.causal_conv1d_varlen
        monkeypatch.setattr(gated_deltanet, "gated_delta_decode",
                            lambda mixed, *a, **kw: linear.append(("decode", mixed.shape[0]))
                            or real_decode(mixed, *a, **kw))
        monkeypatch.setattr(gated_deltanet, "causal_conv1d_varlen",
                            lambda x, state, w, cu, *a, **kw: linear.append(("prefill", cu.numel() - 1))
                            or real_conv(x, state, w, cu, *a, **kw))
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        first = [eng.add_request(prompt_of(20 + 3 * i, seed=30 + i), greedy) for i in range(2)]
        while not all(s.output_ids for s in first):
            eng.step()
        seen.clear()
        linear.clear()
        late = eng.add_request(prompt_of(25, seed=40), greedy)
        eng.step()  # the late prompt beside the two decoding rows
        mixed = [(rows, n) for rows, n in seen]
        calls = list(linear)
        logits = eng.last_logits.clone()
        eng.run_until_done(first + [late])
        monkeypatch.undo()
        return mixed, calls, logits, [s.output_ids for s in first + [late]]

    mixed, calls, logits, tokens = run(True)
    assert mixed and all(n == 3 and rows is not None for rows, n in mixed)
    rows = mixed[0][0]
    assert rows.seq_lens.tolist() == [21, 24] and rows.page_table.shape[0] == 2  # prompt + first token each
    assert calls and calls == [("decode", 2), ("prefill", 1)] * (len(calls) // 2)  # each linear-attention layer
    off, calls_off, logits_off, tokens_off = run(False)
    assert off and all(rows is None for rows, _ in off)
    assert calls_off and set(calls_off) == {("prefill", 3)}  # the rows as sequences of the packed prefill
    assert tokens == tokens_off
    assert torch.allclose(logits, logits_off, rtol=1e-4, atol=1e-4)
