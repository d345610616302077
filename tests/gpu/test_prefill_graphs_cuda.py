"""Prefills under CUDA graphs (`ft.engine.worker.prefill_graphs`): a bucket's first prefill runs eagerly
(padded) and captures, later ones replay; the replay gives the padded eager prefill's logits bit for
bit, and the tokens of an engine without prefill graphs (prefix hits, chunked prompts and a rebuild
included)."""

from __future__ import annotations

import pytest
import torch

from ft.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

LENGTHS = [2, 5, 64, 200, 700, 1024]  # (one token stays eager: the runner's rule)
NEW = 16


def make(model: str, **kw) -> LLM:
    opts = dict(device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=8192, max_running_requests=4,
                enable_prefix_cache=False)
    return LLM(model=model, **{**opts, **kw})


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def first(llm: LLM, p: list[int]) -> tuple[torch.Tensor, list[int]]:
    e = llm.engine
    seq = e.add_request(p, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        e.step()
    logits = e.last_logits[0].clone()
    e.run_until_done([seq])
    return logits, list(seq.output_ids)


def test_replay_equals_padded_eager_bitwise_and_tokens_match(model):
    graphs, eager = make(model), make(model, prefill_graph_max_tokens=0)
    g = graphs.engine.runner.prefill_graphs
    assert g is not None and eager.engine.runner.prefill_graphs is None
    for n in LENGTHS:
        p = prompt(n, n)
        want = first(eager, p)
        got_eager = first(graphs, p)  # the bucket's first prefill: eager, padded, then captured
        replays = g.replays
        got_replay = first(graphs, p)  # the same prompt again: replayed
        assert g.replays == replays + 1, n
        assert torch.equal(got_replay[0], got_eager[0]), n
        assert got_replay[1] == got_eager[1] == want[1], n
        assert (got_replay[0].float() - want[0].float()).abs().max() < 0.05 * want[0].float().abs().max(), n
    assert g.disabled is None and g.captures == len({g.bucket(n) for n in LENGTHS})


def test_prefix_hits_chunks_and_rebuild(model):
    """Prefills after a cached prefix (start > 0), the last chunk of a chunked prompt, and a VMM
    rebuild between replays (no recapture: the addresses stay) keep the eager engine's tokens."""
    shared = prompt(300, 1)
    prompts = [shared + prompt(40, 2), shared + prompt(90, 3), prompt(1500, 4)]
    opts = dict(enable_prefix_cache=True, max_prefill_length=1024)
    eager = make(model, prefill_graph_max_tokens=0, **opts)
    graphs = make(model, **opts)
    want = [first(eager, p)[1] for p in prompts]
    assert [first(graphs, p)[1] for p in prompts] == want
    e = graphs.engine
    captures = e.runner.prefill_graphs.captures
    e.cache.rebuild(kv=4096, mamba=e.cache.geometry.mamba_slots + 2)
    assert [first(graphs, p)[1] for p in prompts] == want
    g = e.runner.prefill_graphs
    assert g.replays > 0 and g.captures == captures and g.disabled is None


def test_concurrent_prompts_share_one_graph_batch(model):
    """Several prompts prefilled in one step (max_seqs raised on the instance: `MAX_SEQS` stays 1 until
    this passes on the device) capture and replay graphs keyed by (bucket, sequences), and keep the
    tokens of an eager engine given the same prompts at once. Written in session 15, not yet run."""
    prompts = [prompt(n, 10 + n) for n in (30, 200, 77)]
    eager, graphs = make(model, prefill_graph_max_tokens=0), make(model)
    g = graphs.engine.runner.prefill_graphs
    g.max_seqs = 3

    def together(llm: LLM) -> list[list[int]]:
        e = llm.engine
        seqs = [e.add_request(p, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
                for p in prompts]
        e.run_until_done(seqs)
        return [list(s.output_ids) for s in seqs]

    want = together(eager)
    assert together(graphs) == want  # the batch's bucket: eager (padded), then captured
    replays = g.replays
    assert together(graphs) == want  # replayed
    assert g.replays > replays and g.disabled is None
    assert any(seqs == 3 for _, seqs in g._graphs), "the three prompts did not share one prefill step"
