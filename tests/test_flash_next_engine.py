"""Qwen3.8-Flash-Next through the engine (`ft.model.qwen3_8_flash_next` over the pools, loaded from a
checkpoint on disk) against the whole-sequence reference forward (`forward_logits`, itself equal to the
public implementation: tests/test_flash_next_oracle.py), on tiny random fp32 checkpoints under the
released names (grouped experts, split GDN projections, the n-gram table in parts): greedy tokens
identical, through one prefill and through chunked prefill (the GDN states, the n-gram context and
the PLE conv history carried across chunks), two requests batched, a prefix-cache hit, YaRN RoPE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ft.engine import LLM
from ft.errors import ConfigError, UnsupportedModelError
from ft.model.config import ModelConfig
from ft.model.qwen3_8_flash_next import hashing_of, tensor_specs
from ft.model.qwen3_8_flash_next_reference import forward_logits
from triton_flags import spy_launches

GREEDY = 8
TEXT = dict(
    vocab_size=320, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4,
    ple_layer_ids=[2], ple_embed_dim=32, ngram_size=3, heads_per_ngram=4, ngram_vocab_size_base=40,
    make_ngram_vocab_size_divisible_by=8, eos_token_id=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
CASES = {
    "ple-hc2": {},
    "hc4-yarn-nople": dict(hc_count=4, ple_layer_ids=[], num_hidden_layers=8, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
        "original_max_position_embeddings": 16}),
}


def write_checkpoint(path: Path, text: dict, seed: int = 0, split_experts: bool = False) -> dict[str, torch.Tensor]:
    """A random fp32 checkpoint (config.json, the table in 3 parts, the demo tokenizer; experts
    grouped per layer, or one tensor per expert and projection with `split_experts`); returns its
    weights under the names the reference forward reads (the table whole, experts grouped)."""
    from ft.tools.demo import write_tokenizer_files

    config = {"architectures": ["Qwen3_8_FlashNextForConditionalGeneration"], "model_type": "qwen3_8_flash_next",
              "text_config": {**text, "dtype": "float32"}, "tie_word_embeddings": False}
    cfg = ModelConfig.from_dict(config)
    specs, _ = tensor_specs(cfg)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, spec in specs.items():
        if spec.kind == "optional":
            continue
        shape = spec.shape
        if name.endswith("A_log"):
            w = torch.rand(shape, generator=g) * 2
        elif name.endswith("dt_bias") or "norm" in name:
            w = torch.randn(shape, generator=g) * 0.1
        elif name.endswith("conv1d.weight"):
            w = torch.randn(shape, generator=g) * 0.3
        elif "embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight"):
            w = torch.randn(shape, generator=g) * 0.5
        else:
            w = torch.randn(shape, generator=g) * (0.3 / shape[-1] ** 0.5 * 4)
        weights[name] = w.contiguous()
    stored = dict(weights)
    table = next((n for n in stored if n.endswith("ngram_embedding.weight")), None)
    if table is not None:  # stored in row-contiguous parts, as the released checkpoint stores it
        stem = table.removesuffix(".weight")
        for i, part in enumerate(stored.pop(table).tensor_split(3)):
            stored[f"{stem}.shard_{i}.weight"] = part.contiguous()
    for name in [n for n in stored if n.endswith("experts.gate_up_proj")] if split_experts else []:
        prefix, gate_up = name.removesuffix("gate_up_proj"), stored.pop(name)
        down, inter = stored.pop(prefix + "down_proj"), gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            stored[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
            stored[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
            stored[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    write_tokenizer_files(path)
    return weights


def reference_greedy(weights: dict, path: Path, prompt: list[int], n: int = GREEDY) -> list[int]:
    cfg = ModelConfig.from_file(path)
    hashing = hashing_of(cfg) if cfg.flash_next.ple_layers else None
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(forward_logits(torch.tensor(ids), weights, cfg.flash_next, hashing)[-1].argmax()))
    return ids[len(prompt):]


def prompt_of(n: int, seed: int, eos_at: tuple[int, ...] = ()) -> list[int]:
    ids = torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in eos_at:
        ids[i] = 2
    return ids


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    weights = write_checkpoint(path, {**TEXT, **CASES[request.param]})
    return request.param, path, weights


def make_llm(path: Path, **opts) -> LLM:
    # KV for 512 tokens: the pool holds both turns' prefixes (sized by the 67-token context limit
    # alone it would evict the first request's entry to run the second)
    base = dict(device="cpu", dtype="float32", page_size=16, max_running_requests=4, num_tokens=512)
    return LLM(model=str(path), **{**base, **opts})


GREEDY_OPTS = dict(max_new_tokens=GREEDY, temperature=0.0, ignore_eos=True)


def test_greedy_tokens_equal_the_reference(checkpoint):
    """One prefill and chunked prefill (chunks of 16: the n-gram context and the conv history cross
    them), two prompts at once (EOS ids inside one: the hash resets there), a second turn that hits
    the prefix cache."""
    name, path, weights = checkpoint
    a, b = prompt_of(40, 1, eos_at=(17, 30)), prompt_of(29, 2)
    want_a, want_b = reference_greedy(weights, path, a), reference_greedy(weights, path, b)
    assert want_a != want_b
    with make_llm(path) as llm:
        got = llm.generate(prompt_token_ids=[a, b], **GREEDY_OPTS)
        assert [r.token_ids for r in got] == [want_a, want_b], name
        turn2 = a + want_a + prompt_of(5, 3)
        out2 = llm.generate(prompt_token_ids=[turn2], **GREEDY_OPTS)[0]
        # everything the first turn fed through the model came from the cache (its mamba slot's states)
        assert out2.num_cached_tokens == len(a) + GREEDY - 1
        assert out2.token_ids == reference_greedy(weights, path, turn2), name
    with make_llm(path, prefix_states_on_host=True) as llm:  # the entry's states (n-gram context and PLE
        # history among them) wait in host memory and come back on the hit
        llm.generate(prompt_token_ids=[a], **GREEDY_OPTS)
        assert llm.engine.prefix_cache.host_bytes == llm.engine.pools.mamba.bytes_per_slot
        out2 = llm.generate(prompt_token_ids=[turn2], **GREEDY_OPTS)[0]
        assert out2.num_cached_tokens == len(a) + GREEDY - 1
        assert out2.token_ids == reference_greedy(weights, path, turn2), name
    with make_llm(path, max_prefill_length=16) as llm:
        model, chunks = llm.engine.model, []
        forward = model.forward
        model.forward = lambda batch, pools: (chunks.append(batch.input_ids.shape[0]), forward(batch, pools))[1]
        assert llm.generate(prompt_token_ids=[a], **GREEDY_OPTS)[0].token_ids == want_a, name
        assert chunks[:3] == [16, 16, 8]  # the prompt in three chunks


def test_the_ngram_table_read_from_disk_gives_the_reference_tokens(checkpoint):
    """--ngram-table disk: the table is mapped from the checkpoint's parts, the host reads each step's rows
    (prefill chunks crossing the context, EOS ids inside a prompt, two prompts at once, a prefix-cache
    hit, decode steps) and the tokens stay the reference's; nothing of it is in host memory's tables."""
    name, path, weights = checkpoint
    if not CASES[name].get("ple_layer_ids", TEXT["ple_layer_ids"]):
        with pytest.raises(ConfigError, match="has no n-gram table"):
            make_llm(path, ngram_table="disk")
        return
    a, b = prompt_of(40, 1, eos_at=(17, 30)), prompt_of(29, 2)
    want_a, want_b = reference_greedy(weights, path, a), reference_greedy(weights, path, b)
    with make_llm(path, ngram_table="disk", max_prefill_length=16) as llm:
        model = llm.engine.model
        assert model.paged_table is not None and "n-gram table" not in model.host_tables
        assert model.disk_tables["n-gram table"] == model.paged_table.nbytes > 0
        # the step rows' device buffer, allocated after the budget is measured, is in the budget's reserve
        rows = llm.engine.runner.ngram_rows.device_buffer
        assert llm.engine.step_rows_bytes == rows.numel() * rows.element_size() > 0
        from ft.engine.core.admin import cache_state  # (what `ft ctl cache` and `ft top` show)

        state = cache_state(llm.engine, "serving", "m")
        assert state.disk_tables == model.disk_tables and "n-gram table" not in state.host_tables
        reads = []
        gather = model.paged_table.gather
        model.paged_table.gather = lambda rows: (reads.append(rows.numel()), gather(rows))[1]
        got = llm.generate(prompt_token_ids=[a, b], **GREEDY_OPTS)
        assert [r.token_ids for r in got] == [want_a, want_b], name
        # every token's rows read exactly once (a chunk read ahead that a step cut otherwise: taken as far as it
        # matches, its rest kept; it was read again), and the prompts' later chunks taken from their reads ahead
        assert sum(reads) == (len(a) + len(b) + 2 * (GREEDY - 1)) * model.hashing.num_heads
        assert model.ngram_reader.taken >= 2
        # every token computed took its rows once (`/metrics` ft_ngram_table_rows_read), and the steps waited on them
        from ft.engine.core.stats import engine_stats

        stats = engine_stats(llm.engine)
        assert stats.ngram_rows_read == (len(a) + len(b) + 2 * (GREEDY - 1)) * model.hashing.num_heads
        assert stats.ngram_read_seconds > 0
        turn2 = a + want_a + prompt_of(5, 3)
        out2 = llm.generate(prompt_token_ids=[turn2], **GREEDY_OPTS)[0]
        assert out2.num_cached_tokens == len(a) + GREEDY - 1
        assert out2.token_ids == reference_greedy(weights, path, turn2), name


@pytest.mark.parametrize("overlap", [False, True])
def test_a_gated_decode_step_that_fails_leaves_the_gate_as_it_found_it(tmp_path, monkeypatch, overlap):
    """A decode step whose n-gram rows go through the gate (a stand-in for the CUDA host flag, played in order)
    and whose forward raises before its gate is queued: its rows were staged, so the flag was set with no pass
    to consume it. The runner takes the set back (`RowsBuffer.settle`); else the next step's gate would pass on
    it, before its own rows were staged."""
    from tests.test_rows_gate import DeviceFlag

    path = tmp_path / "ckpt"
    path.mkdir()
    write_checkpoint(path, TEXT)
    with make_llm(path, ngram_table="disk", max_prefill_length=16, overlap_decode=overlap) as llm:
        runner = llm.engine.runner
        runner.ngram_rows.flag = flag = DeviceFlag()
        forward, failed = runner.model.forward, []

        def failing(batch, pools):
            if batch.decode is not None and not failed:
                failed.append(batch.ngram_gate is not None)
                raise FloatingPointError("injected")
            return forward(batch, pools)

        monkeypatch.setattr(runner.model, "forward", failing)
        with pytest.raises(FloatingPointError, match="injected"):
            llm.generate(prompt_token_ids=[prompt_of(20, 5)], **GREEDY_OPTS)
        assert failed == [True] and flag.sets >= 1
        assert not flag.is_set and flag.waiting == 0 and not runner.ngram_rows.owed


def test_the_embedding_in_host_memory_gives_the_same_tokens(checkpoint):
    """--embedding-on-host: the embedding leaves the device weights for the host tables (named in the
    banner) and the tokens stay the reference's, prefill and decode."""
    name, path, weights = checkpoint
    a = prompt_of(40, 1, eos_at=(17,))
    embedding = next(w for n, w in weights.items() if n.endswith("embed_tokens.weight"))
    with make_llm(path) as llm:
        on_device = llm.engine.model.resident_bytes
        assert "embedding" not in llm.engine.describe()["host_tables"]
    with make_llm(path, embedding_on_host=True) as llm:
        model = llm.engine.model
        assert model.embed_on_host and model.resident_bytes == on_device - embedding.numel() * 4
        assert llm.engine.describe()["host_tables"]["embedding"] == embedding.numel() * 4
        from ft.serve_cmd import describe

        assert "embedding 40.0 KiB in host memory" in describe(llm.engine, "http://x")
        assert llm.generate(prompt_token_ids=[a], **GREEDY_OPTS)[0].token_ids == reference_greedy(weights, path, a), name


def test_the_ple_and_the_yarn_factor_are_seen(checkpoint):
    """Negative controls: the reference without the PLE's table rows (or with plain RoPE for YaRN)
    gives other tokens, so the equality above depends on them."""
    name, path, weights = checkpoint
    prompt = prompt_of(40, 1, eos_at=(17, 30))
    cfg = ModelConfig.from_file(path)
    want = reference_greedy(weights, path, prompt)
    if cfg.flash_next.ple_layers:
        table = next(n for n in weights if n.endswith("ngram_embedding.weight"))
        broken = {**weights, table: torch.roll(weights[table], 1, dims=0)}
        assert reference_greedy(broken, path, prompt) != want
    else:
        import dataclasses

        plain = dataclasses.replace(cfg.flash_next, rope_type="default", rope_scaling=())
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY):
                ids.append(int(forward_logits(torch.tensor(ids), weights, plain)[-1].argmax()))
        assert ids[len(prompt):] != want


def test_qsa_past_its_dense_span_equals_the_reference(tmp_path, monkeypatch):
    """Past budget + ratio - 1 tokens (67 here) QSA selects: prompts of 150 and 90 tokens (prefill in
    chunks of 64 that start past the span, then decode) attend to their chosen blocks, as the
    reference's, batched with a prompt still inside the span; the KV cache holds each token's raw
    indexer key (the pool's bytes per page count it)."""
    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 32})
    prompts = [prompt_of(150, 4, eos_at=(70,)), prompt_of(90, 5), prompt_of(20, 6)]
    want = [reference_greedy(weights, path, p) for p in prompts]
    with make_llm(path, max_prefill_length=64, num_tokens=1024) as llm:
        kv = llm.engine.pools.kv
        assert kv.index_keys is not None and kv.index_keys.shape[-1] == TEXT["indexer_head_dim"]
        assert kv.bytes_per_page == kv.kv[0].numel() * 4 + kv.index_keys[0].numel() * 4
        table = next(w for n, w in weights.items() if n.endswith("ngram_embedding.weight"))
        # the table stays on the host, outside the device weights and the cache budget, and is reported
        assert llm.engine.describe()["host_table_bytes"] == table.numel() * 4 == llm.engine.model.host_bytes
        from ft.serve_cmd import describe

        assert "  host: n-gram table 7.0 KiB in host memory" in describe(llm.engine, "http://x")  # the banner
        assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts, **GREEDY_OPTS)] == want
    # the prefill's selection by the decode path's top-k (`QsaOptions.prefill_select_kernel`, the default) and
    # by the torch sort (variant qsa-prefill-select-torch): the same tokens
    from ft.kernels.options import use_kernel_options, variant
    import ft.model.layers.qsa_attention as qsa_attention

    calls = []
    select = qsa_attention.select_decode_tokens
    monkeypatch.setattr(qsa_attention, "select_decode_tokens", lambda *a: calls.append(a[0].shape[0]) or select(*a))
    with make_llm(path, max_prefill_length=64, num_tokens=1024) as llm:
        assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts[:2], **GREEDY_OPTS)] == want[:2]
    # the prefill chunks past the span (86 + 26 query rows) took it, beside the decodes (at most 16 rows)
    assert sum(calls) > 100
    calls.clear()
    with use_kernel_options(variant("qsa-prefill-select-torch")), \
            make_llm(path, max_prefill_length=64, num_tokens=1024) as llm:
        assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts[:2], **GREEDY_OPTS)] == want[:2]
    assert 0 < sum(calls) < 100  # the decodes only


def test_a_chunk_crossing_the_dense_span_runs_its_first_rows_dense(tmp_path, monkeypatch):
    """A prefill chunk that starts inside QSA's dense span (budget 32 + ratio 4 - 1 = 35 positions) and ends
    past it: its queries below position 35 take the causal prefill attention in one call (QSA selects every
    token there), the other 29 their lists, the next chunk's 26 theirs; the tokens stay the reference's."""
    import ft.model.layers.qsa_attention as qsa_attention

    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 32})
    prompt = prompt_of(90, 5)
    want = reference_greedy(weights, path, prompt)
    dense, sparse = [], []
    real_dense, real_sparse = qsa_attention.paged_attention, qsa_attention.sparse_decode_attention
    monkeypatch.setattr(qsa_attention, "paged_attention",
                        lambda q, *a: dense.append((q.shape[0], a[3])) or real_dense(q, *a))
    monkeypatch.setattr(qsa_attention, "sparse_decode_attention",
                        lambda q, *a, **k: sparse.append(q.shape[0]) or real_sparse(q, *a, **k))
    with make_llm(path, max_prefill_length=64, num_tokens=1024) as llm:
        assert [r.token_ids for r in llm.generate(prompt_token_ids=[prompt], **GREEDY_OPTS)] == [want]
    assert dense and set(dense) == {(35, 0)}  # every QSA layer: rows 0 .. 34 of the first chunk
    assert {29, 26} <= set(sparse) and max(sparse) == 29


def test_qsa_selection_is_seen(tmp_path):
    """Negative control: the reference with a budget covering the whole prompt (dense attention)
    gives other tokens for the 150-token prompt, so the equality above depends on the selection."""
    import dataclasses

    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 32})
    prompt = prompt_of(150, 4, eos_at=(70,))
    cfg = ModelConfig.from_file(path)
    dense = dataclasses.replace(cfg.flash_next, indexer_budget=4096)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY):
            ids.append(int(forward_logits(torch.tensor(ids), weights, dense, hashing_of(cfg))[-1].argmax()))
    assert ids[len(prompt):] != reference_greedy(weights, path, prompt)


def test_experts_stored_one_tensor_each_load_alike(tmp_path):
    """The layout ModelOpt writes MoE experts in (`experts.{e}.{gate,up,down}_proj.weight`) loads into
    the same host store: the same tokens as the reference."""
    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "ple_layer_ids": []}, split_experts=True)
    prompt = prompt_of(30, 7)
    with make_llm(path) as llm:
        assert llm.generate(prompt_token_ids=[prompt], **GREEDY_OPTS)[0].token_ids == \
            reference_greedy(weights, path, prompt)


def test_synthetic_flash_next_serves(tmp_path):
    """`synthetic:config.json` (random NVFP4 projections, the split GDN ones stacked, grouped experts in
    the host store, the n-gram table made on the host): it loads and generates from its config alone."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3_8_FlashNextForConditionalGeneration"],
                               "text_config": {**TEXT, "shared_expert_intermediate_size": 32, "dtype": "bfloat16"}}))
    with make_llm(f"synthetic:{cfg}", num_tokens=256) as llm:
        model = llm.engine.model
        assert model.host_bytes == model.layers[1].ple.table.numel() * 4 > 0
        out = llm.generate(prompt_token_ids=[prompt_of(20, 8)], **GREEDY_OPTS)[0]
        assert len(out.token_ids) == GREEDY and torch.isfinite(llm.engine.last_logits).all()


def test_a_synthetic_ngram_table_on_disk_gives_the_same_tokens(tmp_path):
    """--ngram-table disk on a synthetic model: its table (the same values) is written to a temporary file,
    mapped and unlinked; the tokens are those of the table in host memory."""
    import os
    import tempfile

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3_8_FlashNextForConditionalGeneration"],
                               "text_config": {**TEXT, "shared_expert_intermediate_size": 32, "dtype": "bfloat16"}}))
    prompts = [prompt_of(40, 1, eos_at=(17, 30)), prompt_of(29, 2)]
    before = set(os.listdir(tempfile.gettempdir()))
    runs = []
    for where in ("host", "disk"):
        with make_llm(f"synthetic:{cfg}", num_tokens=256, ngram_table=where, max_prefill_length=16) as llm:
            assert (llm.engine.model.paged_table is not None) == (where == "disk")
            runs.append([r.token_ids for r in llm.generate(prompt_token_ids=prompts, **GREEDY_OPTS)])
    assert runs[0] == runs[1]
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("ft-synthetic-table-")]


def test_its_forward_runs_with_its_kernel_choices(tmp_path, monkeypatch):
    """`FlashNextModel.kernel_defaults` are in force inside each forward (prefill and decode: bf16 rows as fp16
    on the NVFP4 tile, `Nvfp4Options.dot_f16_x_max_m` 64) and only there; a variant in force wins over them."""
    import ft.model.qwen3_8_flash_next as fn
    from ft.kernels.options import kernel_options, use_kernel_options, variant

    seen = []
    real = fn.expand_streams
    monkeypatch.setattr(fn, "expand_streams",
                        lambda *a: seen.append(kernel_options().nvfp4.dot_f16_x_max_m) or real(*a))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3_8_FlashNextForConditionalGeneration"],
                               "text_config": {**TEXT, "shared_expert_intermediate_size": 32, "dtype": "bfloat16"}}))
    with make_llm(f"synthetic:{cfg}", num_tokens=256) as llm:
        llm.generate(prompt_token_ids=[prompt_of(20, 8)], max_new_tokens=3, temperature=0.0, ignore_eos=True)
        assert seen and set(seen) == {64} and kernel_options().nvfp4.dot_f16_x_max_m is None
        seen.clear()
        with use_kernel_options(variant("nvfp4-dot-bf16-x")):
            llm.generate(prompt_token_ids=[prompt_of(20, 9)], max_new_tokens=2, temperature=0.0, ignore_eos=True)
        assert seen and set(seen) == {0}


def test_refusals_name_what_is_missing(tmp_path):
    path = tmp_path / "m"
    write_checkpoint(path, {**TEXT, "ple_layer_ids": []})
    with pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        make_llm(path, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--page-size 6: QSA's blocks of 4"):
        make_llm(path, page_size=6)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("indexer_kv_heads", 2, "one key head"), ("indexer_head_dim", 4, "rotates its first 8 features"),
    ("ple_layer_ids", [2, 3], "one PLE layer"), ("indexer_budget", 2, "at least one block"),
])
def test_configs_it_cannot_run_are_refused_in_one_line(tmp_path, field, value, says):
    from ft.model.kernel_support import check_kernel_shapes

    cfg = ModelConfig.from_dict({"architectures": ["Qwen3_8_FlashNextForConditionalGeneration"],
                                 "text_config": {**TEXT, field: value}})
    with pytest.raises(UnsupportedModelError, match=says):
        check_kernel_shapes(cfg, device_type="cpu", quantized=False)


def test_stacked_nvfp4_projections_are_exact():
    """Linear.stacked: NVFP4 projections sharing their global scale become one whose output is their
    outputs side by side, exactly; different global scales are refused, not rounded."""
    from ft.model.layers.linear import Linear, NVFP4Weight

    g = torch.Generator().manual_seed(0)

    def weight(n: int, scale_2: float) -> NVFP4Weight:
        return NVFP4Weight(torch.randint(0, 256, (n, 16), generator=g, dtype=torch.uint8),
                           (torch.rand(n, 2, generator=g) + 0.5).to(torch.float8_e4m3fn), torch.tensor(scale_2))

    a, b = weight(24, 0.01), weight(8, 0.01)
    x = torch.randn(5, 32, generator=g)
    stacked = Linear.stacked([a, b])
    assert torch.equal(stacked.weight.dequantize(torch.float32),  # the very same values
                       torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)]))
    torch.testing.assert_close(stacked(x), torch.cat([Linear(a)(x), Linear(b)(x)], dim=-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="different global scales"):
        Linear.stacked([a, weight(8, 0.02)])


def test_ft_serve_answers_with_it(tmp_path):
    """`ft serve` on a Qwen3.8-Flash-Next checkpoint, with a real HTTP client: a completion answers, an
    image part is a 400 that says why, GET /admin/cache reports the n-gram table's host bytes."""
    from server_proc import ServerProcess

    path = tmp_path / "flash-next-tiny"
    write_checkpoint(path, TEXT)
    srv = ServerProcess("--model", str(path), "--device", "cpu", "--num-tokens", "512", "--max-running-requests", "2")
    try:
        model = srv.get("/v1/models").json()["data"][0]["id"]
        r = srv.post("/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        r = srv.post("/v1/chat/completions", json={"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                         {"type": "text", "text": "what is this?"}]}]})
        assert r.status_code == 400 and "only text parts" in r.text
        cache = srv.get("/admin/cache").json()
        assert cache["host_table_bytes"] > 0
    finally:
        assert srv.stop() == 0, srv.output()


def test_ft_quantize_writes_a_checkpoint_it_loads(tmp_path):
    """`ft quantize` on a Qwen3.8-Flash-Next checkpoint: its grouped experts written one NVFP4 module per
    expert and projection, the split GDN projections quantized with a shared global scale (so that
    they stack), the HyperConnections, the PLE layer and its n-gram table left dense; the engine loads
    it and its greedy tokens equal the reference's on the dequantized weights."""
    from safetensors.torch import load_file

    from ft.model.layers.linear import NVFP4Weight
    from ft.tools.quantize_checkpoint import quantize_checkpoint

    src, dst = tmp_path / "src", tmp_path / "nvfp4"
    text = {**TEXT, "shared_expert_intermediate_size": 32}
    write_checkpoint(src, text)
    quantize_checkpoint(src, dst, progress=False)
    stored = load_file(str(dst / "model.safetensors"))
    assert not any(n.endswith("gate_up_proj") for n in stored)
    assert stored["model.language_model.layers.0.mlp.experts.7.down_proj.weight"].dtype == torch.uint8
    qkv, z = (stored[f"model.language_model.layers.0.linear_attn.{p}.weight_scale_2"] for p in ("in_proj_qkv", "in_proj_z"))
    assert torch.equal(qkv, z)
    assert all(stored[n].dtype == torch.float32 for n in stored if "hyper_connection" in n or ".ple." in n)
    # the reference reads dense weights under the released names: dequantize, regroup the experts
    dense, parts = {}, {}
    for name, t in stored.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        module = name.removesuffix(".weight")
        if t.dtype == torch.uint8:
            t = NVFP4Weight(t, stored[module + ".weight_scale"], stored[module + ".weight_scale_2"]).dequantize(torch.float32)
        if ".ngram_embedding.shard_" in name:
            parts[int(name.split(".shard_")[1].split(".")[0])] = (name.split(".shard_")[0] + ".weight", t)
            continue
        dense[name] = t
    table = parts[0][0]
    dense[table] = torch.cat([parts[i][1] for i in sorted(parts)])
    for layer in range(text["num_hidden_layers"]):
        m = f"model.language_model.layers.{layer}.mlp.experts."
        experts = range(text["num_experts"])
        dense[m + "gate_up_proj"] = torch.stack([torch.cat([dense.pop(f"{m}{e}.gate_proj.weight"),
                                                            dense.pop(f"{m}{e}.up_proj.weight")]) for e in experts])
        dense[m + "down_proj"] = torch.stack([dense.pop(f"{m}{e}.down_proj.weight") for e in experts])
    prompt = prompt_of(30, 9, eos_at=(11,))
    with make_llm(dst) as llm:
        assert llm.generate(prompt_token_ids=[prompt], **GREEDY_OPTS)[0].token_ids == reference_greedy(dense, dst, prompt)


@pytest.mark.parametrize("table", ["host", "disk"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_padding_rows_of_a_decode_step_write_no_live_state(tmp_path, monkeypatch, overlap, table):
    """A CUDA graph's padding rows (and overlapped decode's rows that ended) carry slot -1: the step must
    write none of their states. Forced here on the CPU (every decode step padded by two rows, eagerly),
    with the mamba pool exactly full and the KV pool's last page in use, so that a write at index -1
    would land in a live sequence's n-gram context, PLE conv history or raw indexer key: the tokens
    stay the reference's. Overlapped: the rows of sequences that ended in the step in flight too. With the
    n-gram table on disk the host reads each step's rows (overlapped: once the step in flight's ids are in)."""
    from ft.engine.worker.model_runner import ModelRunner

    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 32})
    prompts = [prompt_of(40, 8, eos_at=(11,)), prompt_of(33, 9), prompt_of(50, 10)]
    want = [reference_greedy(weights, path, p) for p in prompts]
    padded = []
    monkeypatch.setattr(ModelRunner, "graph_rows_for", lambda self, b: padded.append(b) or b + 2)
    # 3 mamba slots for 3 requests; 144 token slots (9 pages of 16) for 40 + 33 + 50 prompts and 7 decode
    # steps each: every page in use by the last steps, the last one among them
    with make_llm(path, max_running_requests=3, mamba_cache_size=3, num_tokens=144, enable_prefix_cache=False,
                  overlap_decode=overlap, ngram_table=table) as llm:
        assert llm.engine.pools.mamba.num_slots == 3 and (llm.engine.model.paged_table is not None) == (table == "disk")
        got = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, **GREEDY_OPTS)]
        assert llm.engine.overlapped_steps > 0 if overlap else llm.engine.overlapped_steps == 0
    assert padded  # the decode steps took the padded path
    assert got == want


def mixed_step_case(tmp_path: Path, monkeypatch) -> tuple[Path, list[list[int]], list[list[int]], list]:
    """The mixed step both devices' tests run (here and `tests/gpu/test_flash_next_cuda.py`): a checkpoint with
    a QSA budget of 32 tokens (dense span 35), three prompts (two to decode past the span, one to arrive), their
    reference tokens (4 each), and the list that records each `QSAAttention._decode` call as (ungated, the
    rows' seq_lens)."""
    import ft.model.layers.qsa_attention as qsa_attention

    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 32})
    prompts = [prompt_of(60, 21), prompt_of(45, 22), prompt_of(50, 23)]
    want = [reference_greedy(weights, path, p, n=4) for p in prompts]
    rows: list = []
    real = qsa_attention.QSAAttention._decode
    monkeypatch.setattr(qsa_attention.QSAAttention, "_decode",
                        lambda self, q, iq, gate, d, *a: rows.append((gate is None, d.seq_lens.tolist()))
                        or real(self, q, iq, gate, d, *a))
    return path, prompts, want, rows


def run_mixed_step(llm: LLM, prompts: list[list[int]], rows: list) -> tuple[list[int], list, list[list[int]]]:
    """The first two prompts until both decode, then the third beside them (one mixed step), then to the end:
    -> (the decoding rows' lengths with their new token, the `_decode` calls of the mixed step, every
    request's greedy tokens)."""
    from ft.engine import SamplingParams

    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    eng = llm.engine
    first = [eng.add_request(p, greedy) for p in prompts[:2]]
    while not all(s.output_ids for s in first):
        eng.step()
    rows.clear()
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in first]  # each row's context with its new token
    late = eng.add_request(prompts[2], greedy)
    eng.step()  # the late prompt beside the two decoding rows
    mixed = list(rows)
    eng.run_until_done(first + [late])
    return lengths, mixed, [s.output_ids for s in first + [late]]


def test_a_mixed_steps_decoding_rows_past_the_dense_span_take_the_decode_selection(tmp_path, monkeypatch):
    """A prompt prefilled beside two streams decoding past QSA's dense span (a budget of 32 tokens: 35): the
    streams' rows run as one decode batch (`ForwardBatch.decode_rows` through `_decode`: one selection, one
    sparse attention), the prompt as a prefill; every request's greedy tokens are the reference's."""
    path, prompts, want, rows = mixed_step_case(tmp_path, monkeypatch)
    with make_llm(path, max_prefill_length=64, num_tokens=1024) as llm:
        lengths, mixed, got = run_mixed_step(llm, prompts, rows)
    assert min(lengths) > 35
    assert mixed and all(r == (True, lengths) for r in mixed)  # ungated: the mixed step gates every row later
    assert got == want


def test_the_triton_kernels_give_the_reference_tokens(tmp_path, monkeypatch):
    """The decode path as it runs on a GPU (every dispatcher on its Triton kernel, here in the
    interpreter: QSA's indexer query normed and rotated in one launch, its sparse attention's splits
    combined and gated in one, the slot writes, the HyperConnection and MoE kernels): greedy tokens equal
    the reference's, past QSA's dense span (a budget of 8 tokens), two sequences batched."""
    path = tmp_path / "m"
    weights = write_checkpoint(path, {**TEXT, "indexer_budget": 8})
    # both past the dense span (budget + ratio - 1 = 11 tokens) before the first decode step
    prompts = [prompt_of(16, 11, eos_at=(9,)), prompt_of(13, 12)]
    want = [reference_greedy(weights, path, p, n=3) for p in prompts]
    pytest.importorskip("triton")
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.attention.sparse_decode as sparse_decode

    launched = spy_launches(monkeypatch, sparse_decode, "_sparse_decode_kernel")
    with make_llm(path) as llm:
        got = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, max_new_tokens=3, temperature=0.0,
                                                 ignore_eos=True)]
    assert launched  # the Triton path ran
    assert got == want
