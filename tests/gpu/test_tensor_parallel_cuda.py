"""Tensor parallelism on two GPUs (NCCL): the one-GPU engine's greedy tokens in fp32, graph replay
equal to eager and offload equal to resident bitwise in bf16 on each rank, a rebuild between
replays. Skipped with fewer than two GPUs (device kind nvidia-h200-x2)."""

from __future__ import annotations

import json

import pytest
import torch

from ft.engine.engine import Engine
from ft.engine.engine_config import EngineConfig
from ft.engine.sampling_params import SamplingParams
from gpu.test_engine_cuda import SMALL_BF16_CONFIG

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")]

PROMPTS = [list(range(100, 140)), list(range(300, 317)), list(range(500, 590))]
NEW = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("synthetic-tp") / "config.json"
    path.write_text(json.dumps(SMALL_BF16_CONFIG))
    return f"synthetic:{path}"


def generate(model: str, tp: int, prompts=PROMPTS, rebuild_after: int | None = None, **kw) -> list[list[int]]:
    opts = dict(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=4096,
                max_running_requests=4, tensor_parallel_size=tp)
    eng = Engine(EngineConfig(**{**opts, **kw}))
    try:
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
                for p in prompts]
        steps = 0
        while any(not s.is_finished for s in seqs):
            eng.step()
            steps += 1
            if steps == rebuild_after:
                eng.cache.rebuild(kv=8192)
        if kw.get("dtype", "bfloat16") == "bfloat16" and not kw.get("disable_cuda_graph"):
            assert eng.runner.graphs.replays > 0  # (dense fp32 experts run the reference MoE: eager)
        return [s.output_ids for s in seqs]
    finally:
        eng.close()


def test_two_gpus_give_the_one_gpu_greedy_tokens_in_fp32(tiny_one):
    _, model, path = tiny_one
    prompts = [[t % model.config.vocab_size for t in p] for p in PROMPTS]
    kw = dict(dtype="float32", moe_backend="offload", prompts=prompts)
    assert generate(str(path), 2, **kw) == generate(str(path), 1, **kw)


def test_two_gpus_graph_replay_equals_eager_bitwise(model):
    assert generate(model, 2) == generate(model, 2, disable_cuda_graph=True)


def test_two_gpus_offload_read_through_equals_resident_bitwise(model):
    few = 2 * SMALL_BF16_CONFIG["num_experts_per_tok"]
    assert generate(model, 2, moe_backend="offload", moe_cache_size=few) == generate(model, 2)


def test_two_gpus_rebuild_between_replays_keeps_tokens(model):
    assert generate(model, 2, rebuild_after=6) == generate(model, 2)
