"""Tensor parallelism on the CPU: two ranks (two processes, gloo) give the one-process engine's tokens,
and a rebuild is joint (all ranks commit or all roll back)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY_CONFIGS
from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams
from ft.errors import ConfigError, RanksOutOfStep, RebuildFailed
from ft.model.config import ModelConfig
from ft.model.layers.linear import NVFP4Weight
from ft.model.tp_shard import shard_tensors
from ft.model.tp_split import local_config
from ft.parallel.control_channel import supported as channel_supported

GREEDY = dict(max_new_tokens=10, temperature=0.0)


def _engine(path, tp: int, **kw) -> Engine:
    opts = dict(model=str(path), device="cpu", dtype="float32", num_tokens=1024, max_running_requests=4,
                tensor_parallel_size=tp)
    return Engine(EngineConfig(**{**opts, **kw}))


def _prompts(n: int = 3) -> list[list[int]]:
    return [list(range(3 + i, 30 + 9 * i)) for i in range(n)]


def _generate(eng: Engine, prompts, params=None, n: int = 1) -> list[list[int]]:
    params = params or SamplingParams(**GREEDY)
    seqs = []
    for p in prompts:
        seqs += eng.add_request_group(p, [params] * n) if n > 1 else [eng.add_request(p, params)]
    eng.run_until_done(seqs, timeout_s=120)
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def reference(tiny):
    """The one-process engine's greedy tokens for the tiny model (name, path, tokens)."""
    name, _, path = tiny
    eng = _engine(path, 1)
    return name, path, _generate(eng, _prompts())


def test_two_ranks_give_the_one_process_tokens(reference):
    name, path, want = reference
    eng = _engine(path, 2)
    try:
        assert eng.tp is not None and eng.tp.world == 2
        vocab = eng.model_config.vocab_size
        assert eng.model.embed.shape[0] == vocab // 2 and eng.model.vocab_lo == 0  # the vocabulary is split
        assert _generate(eng, _prompts()) == want, name
    finally:
        eng.close()


def test_two_ranks_offloaded_chunked_prefix_cached_and_forked_match_one_process(tiny_one):
    """Few expert slots (misses every step), prompts in chunks, a prefix-cache hit (copied
    pages and state on rank 0, replayed on rank 1 from the journal) and n > 1 siblings forking."""
    _, model, path = tiny_one
    kw = dict(moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok, max_prefill_length=16)
    shared = list(range(5, 60))
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    one = _engine(path, 1, **kw)
    want = _generate(one, prompts) + _generate(one, prompts[:1], sampled, n=3)
    eng = _engine(path, 2, **kw)
    try:
        got = _generate(eng, prompts) + _generate(eng, prompts[:1], sampled, n=3)
    finally:
        eng.close()
    assert got == want


def test_logits_match_one_process_closely(tiny_one):
    _, _, path = tiny_one
    rows = []
    for tp in (1, 2):
        eng = _engine(path, tp)
        try:
            eng.add_request(_prompts(1)[0], SamplingParams(max_new_tokens=1, temperature=0.0))
            eng.step()
            rows.append(eng.last_logits.clone())
        finally:
            eng.close()
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-4, atol=1e-4)


def test_a_rebuild_is_joint_and_a_fault_on_one_rank_rolls_back_both(tiny_one):
    _, model, path = tiny_one
    kw = dict(moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok)
    want = _generate(_engine(path, 1, **kw), _prompts())
    eng = _engine(path, 2, **kw)
    try:
        before = eng.cache.geometry
        entry = eng.cache.rebuild(kv=2048)  # grow: both ranks
        assert entry["status"] == "ok" and [r["rank"] for r in entry["ranks"]] == [0, 1]
        from ft.ctl.format import format_history
        from ft.engine.core.admin import history

        assert "peaks: gpu 0 " in format_history(history(eng)) and ", gpu 1 " in format_history(history(eng))
        assert eng.cache.peers.describes[0]["geometry"]["kv_tokens"] == 2048 == eng.cache.geometry.kv_tokens
        eng.cache.peers.fault_rank = 1  # rank 1 fails its next resize: rank 0 had already resized
        with pytest.raises(RebuildFailed, match="rank 1"):
            eng.cache.rebuild(kv=before.kv_tokens)
        assert eng.cache.geometry.kv_tokens == 2048
        assert eng.cache.history[-1]["status"] == "rolled_back"
        assert eng.cache.peers.describe()[0]["geometry"]["kv_tokens"] == 2048
        assert eng.cache.degraded is None
        assert _generate(eng, _prompts()) == want  # both ranks serve on, in step
        eng.cache.rebuild(kv=before.kv_tokens)  # and a shrink goes through on both
        assert eng.cache.peers.describe()[0]["geometry"]["kv_tokens"] == before.kv_tokens
        assert _generate(eng, _prompts()) == want
    finally:
        eng.close()


def test_a_model_that_does_not_split_is_refused_in_one_line():
    cfg = ModelConfig.from_dict({**_BASE_CONFIG, **TINY_CONFIGS["interval2-gqa2-top2"]})
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        local_config(cfg, 0, 3)
    small = local_config(cfg, 1, 2)
    assert (small.num_attention_heads, small.num_key_value_heads, small.moe_intermediate_size) == (2, 1, 16)


def test_an_nvfp4_column_cut_inside_a_block_is_refused():
    cfg = ModelConfig.from_dict({**_BASE_CONFIG, **TINY_CONFIGS["interval2-gqa2-top2"],
                                 "shared_expert_intermediate_size": 48})
    name = "model.layers.0.mlp.shared_expert.down_proj.weight"
    w = NVFP4Weight(torch.zeros(64, 24, dtype=torch.uint8), torch.zeros(64, 3, dtype=torch.float8_e4m3fn),
                    torch.tensor(1.0))
    tensors = {n: torch.zeros(1) for n in ()}
    tensors[name] = w
    with pytest.raises(ConfigError, match="splits an NVFP4 block"):
        shard_tensors(_dense_rest(cfg, tensors), cfg, 0, 2)


_BASE_CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=320, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    max_position_embeddings=512, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def _dense_rest(cfg: ModelConfig, tensors: dict) -> dict:
    """Every tensor of `cfg` as a dense stand-in of its shape, except those given."""
    from ft.model.qwen3_next import tensor_specs

    specs, _ = tensor_specs(cfg)
    out = {n: torch.zeros(s.shape) for n, s in specs.items() if s.kind != "expert"}
    out.update(tensors)
    return out


def test_admin_cache_and_ctl_show_every_gpu(tiny_one):
    from ft.ctl.format import format_cache
    from ft.engine.core.admin import cache_state

    _, model, path = tiny_one
    eng = _engine(path, 2, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok)
    try:
        _generate(eng, _prompts(1))
        state = cache_state(eng, "serving", "tiny")
        assert [r.rank for r in state.ranks] == [0, 1]
        # every rank routes alike and caches alike: the same counters (rank 0's are the engine's)
        assert state.ranks[1].hits == state.ranks[0].hits == eng.pools.experts.stats.hits > 0
        assert state.ranks[1].misses == state.ranks[0].misses > 0
        assert all(r.kv_tokens == eng.cache.geometry.kv_tokens for r in state.ranks)
        text = format_cache(state)
        assert "gpu 0: moe" in text and "gpu 1: moe" in text and "% hits" in text
    finally:
        eng.close()
    one = _engine(path, 1)
    assert cache_state(one, "serving", "tiny").ranks == []


def test_serve_refuses_a_split_the_model_does_not_allow_before_loading(tiny_one):
    from test_cli import _run_cli

    _, _, path = tiny_one
    rc, err, torch_loaded = _run_cli("serve", str(path), "--tensor-parallel-size", "3", "--port", "0")
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1, err
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in lines[0]
    assert not torch_loaded


def test_a_worker_that_dies_fails_the_next_step_in_one_line_instead_of_hanging(tiny_one):
    _, _, path = tiny_one
    eng = _engine(path, 2)
    try:
        proc = eng._workers.procs[0]
        proc.kill()
        proc.join(10)
        eng.add_request(_prompts(1)[0], SamplingParams(**GREEDY))
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            eng.step()
        assert "restart ft serve" in eng.tp_failure
    finally:
        eng.close()  # bounded: the dead rank is not waited for


def test_rank_0_failing_a_started_step_stops_the_engine_in_one_line(tiny_one):
    """The workers run a step rank 0 then fails (here its forward raises): they wait in a
    collective that will never come, so the engine refuses every later step and says why
    (`tp_failure`, /health failed) instead of pairing the next step's collectives with theirs."""
    _, _, path = tiny_one
    eng = _engine(path, 2)
    try:
        eng.add_request(_prompts(1)[0], SamplingParams(**GREEDY))
        forward = eng.model.forward

        def broken(*a, **kw):
            raise torch.cuda.OutOfMemoryError("injected on rank 0")

        eng.model.forward = broken
        with pytest.raises(RanksOutOfStep, match="out of step: restart ft serve"):
            eng.step()
        eng.model.forward = forward
        with pytest.raises(RuntimeError, match="injected on rank 0"):
            eng.step()  # refused before anything is sent
        assert "OutOfMemoryError" in eng.tp_failure
    finally:
        for proc in eng._workers.procs:  # it waits in a collective: what a restart of ft serve does
            proc.kill()
            proc.join(10)
        eng.close()


def test_the_kv_ladder_moves_every_rank(tiny_one):
    _, model, path = tiny_one
    kw = dict(moe_backend="offload", num_tokens=None, enable_kv_ladder=True, ladder_step_size=128,
              max_prefill_length=64)
    long_prompt = [list(range(3, 300))]
    want = _generate(_engine(path, 1, **kw), long_prompt)
    eng = _engine(path, 2, **kw)
    try:
        start = eng.cache.geometry.kv_tokens
        got = _generate(eng, long_prompt)
        grown = [h for h in eng.cache.history if h["trigger"] == "ladder" and h["status"] == "ok"]
        assert grown and eng.cache.geometry.kv_tokens > start
        assert [r["rank"] for r in grown[0]["ranks"]] == [0, 1]
        assert eng.cache.peers.describe()[0]["geometry"]["kv_tokens"] == eng.cache.geometry.kv_tokens
    finally:
        eng.close()
    assert got == want


def test_the_server_with_two_ranks_answers_as_with_one_and_stops_them(tmp_path):
    from fastapi.testclient import TestClient

    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop
    from server_proc import WAIT_S

    texts, procs = [], []
    for tp in (1, 2):
        loop = EngineLoop(lambda: Engine(EngineConfig(device="cpu", tensor_parallel_size=tp)))
        state = ServerState(loop, "ft-demo", drain_s=0.0)
        with TestClient(create_app(state)) as client:
            assert loop.ready.wait(WAIT_S) and loop.state == "serving", loop.error
            r = client.post("/v1/completions", json={"model": "ft-demo", "prompt": "The cache", "max_tokens": 12,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            ranks = client.get("/admin/cache").json()["ranks"]
            assert len(ranks) == (2 if tp == 2 else 0)
            assert client.get("/health").json()["status"] == "ok"
            if tp == 2:
                procs = list(loop.engine._workers.procs)
        assert all(not p.is_alive() for p in procs)  # the server's shutdown stopped the worker rank
    assert texts[0] == texts[1]


def _echo_rank(rank: int, ports: list[int], objs: list, out, missing_dir: str) -> None:
    from ft.parallel import init_group

    for control, port in zip(CONTROLS, ports):
        os.environ["FT_TP_CONTROL"] = control.split("-")[0]
        if control == "shm-unwritable":
            os.environ["FT_TP_CONTROL_DIR"] = missing_dir
        tp = init_group(rank, 2, port, torch.device("cpu"))
        shm = control == "shm"
        assert (tp.channel is not None) == (shm and channel_supported()), control
        got = [tp.broadcast(o if rank == 0 else None) for o in objs]
        if rank == 1:
            out.put((control, got))
        tp.destroy()


CONTROLS = ("shm", "gloo", "shm-unwritable")


def test_control_messages_arrive_whole_short_and_long(tmp_path):
    """Through the shared-memory channel, through gloo, and through gloo when rank 0 cannot create
    the channel's file (every rank then agrees on gloo): one broadcast for a message that fits the
    buffer, two for a longer one; all arrive equal. One pair of processes runs the three in turn
    (a group each, its environment set before the group starts, as a spawned rank inherits it)."""
    import torch.multiprocessing as mp

    from ft.parallel import free_port
    from ft.parallel.group import MESSAGE_BYTES

    objs = [("step", [1, 2, 3]), ("rebuild", list(range(4 * MESSAGE_BYTES))), None, ("stop", "x" * (MESSAGE_BYTES - 30))]
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), [free_port() for _ in CONTROLS]
    procs = [ctx.Process(target=_echo_rank, args=(r, ports, objs, out, str(tmp_path / "missing"))) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in CONTROLS]
    for p in procs:
        p.join(30)
    assert got == [(control, objs) for control in CONTROLS]


def test_prompt_logprobs_and_sampled_logprobs_match_one_process(tiny_one):
    """Prompt logprobs need the logits of every prompt position (the step's logit index list,
    which the workers receive and ignore); sampled tokens' logprobs come from rank 0's logits."""
    _, _, path = tiny_one
    params = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1)
    got = []
    for tp in (1, 2):
        eng = _engine(path, tp, max_prefill_length=16)
        try:
            seq = eng.add_request(_prompts(1)[0], params)
            eng.run_until_done([seq], timeout_s=120)
            got.append((seq.output_ids, [e.logprob for e in seq.prompt_logprobs[1:]],
                        [e.logprob for e in seq.logprobs]))
        finally:
            eng.close()
    assert got[1][0] == got[0][0]
    # fp32, summed in another order (each rank's partial sums, then the all-reduce)
    assert got[1][1] == pytest.approx(got[0][1], abs=1e-4) and got[1][2] == pytest.approx(got[0][2], abs=1e-4)


def test_a_vocabulary_the_ranks_cannot_split_stays_whole_with_the_logits_on_rank_0():
    cfg = ModelConfig.from_dict({**_BASE_CONFIG, **TINY_CONFIGS["interval2-gqa2-top2"], "vocab_size": 321})
    whole = _dense_rest(cfg, {})
    for rank in (0, 1):
        got = shard_tensors(whole, cfg, rank, 2)
        assert got["model.embed_tokens.weight"].shape[0] == 321
        assert ("lm_head.weight" in got) == (rank == 0)
    even = ModelConfig.from_dict({**_BASE_CONFIG, **TINY_CONFIGS["interval2-gqa2-top2"]})
    got = shard_tensors(_dense_rest(even, {}), even, 1, 2)
    assert got["model.embed_tokens.weight"].shape[0] == got["lm_head.weight"].shape[0] == 160


def test_ft_generate_with_two_ranks_prints_the_one_rank_tokens_and_exits_clean(tiny_one):
    """The command line end to end, in a fresh interpreter: the spawned rank starts from `ft`'s
    entry point, leaves with it, and leaves nothing behind to warn about."""
    import json
    import subprocess
    import sys

    _, _, path = tiny_one
    outs = []
    for tp in ("1", "2"):
        code = ("import sys; from ft.cli import main\n"
                "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))")
        p = subprocess.run([sys.executable, "-c", code, "generate", "--model", str(path), "--device", "cpu", "-tp", tp,
                            "--prompt", "hello", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos",
                            "--json"], capture_output=True, text=True, timeout=180, check=False)
        assert p.returncode == 0, p.stderr
        assert "leaked" not in p.stderr and "Traceback" not in p.stderr, p.stderr
        outs.append(json.loads(p.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_the_host_memory_plan_is_refused_before_any_worker_starts(tiny_one, monkeypatch):
    """Under tensor parallelism rank 0 checks the host's plan (every rank's part of the experts together) before
    it spawns a worker: a refusal leaves no rank loading its part."""
    import ft.engine.ranks.rank_state as rank_state
    import ft.engine.ranks.tp_worker as tp_worker

    _, _, path = tiny_one
    spawned = []
    monkeypatch.setattr(rank_state, "available_bytes", lambda: (1 << 30, "MemAvailable"))
    monkeypatch.setattr(tp_worker, "free_port", lambda: spawned.append(1) or 0)  # (called before the first spawn)
    with pytest.raises(ConfigError, match=r"host memory: this model keeps .* \(routed experts"):
        _engine(path, 2)
    assert not spawned
