"""A decode step's rows without a slot (a CUDA graph bucket's padding rows, -1) on the Qwen3-Next path:
forced on the CPU (every decode step padded by two rows, eagerly) with the mamba pool exactly full, so
that a state write at slot -1 would land in the last slot, a live sequence's. The tokens must be an
unpadded engine's. (Qwen3.8-Flash-Next's padding test is in tests/test_flash_next_engine.py.)"""

from __future__ import annotations

from ft.engine.base.engine_config import EngineConfig
from ft.engine.base.sampling_params import SamplingParams
from ft.engine.core.engine import Engine
from ft.engine.worker.model_runner import ModelRunner
from test_oracle import prompt_of


def _tokens(path) -> list[list[int]]:
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=16, max_running_requests=3,
                              mamba_cache_size=3, moe_backend="resident", enable_prefix_cache=False))
    assert eng.pools.mamba.num_slots == 3
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(prompt_of(20 + 9 * i, seed=60 + i), params) for i in range(3)]
    eng.run_until_done(seqs)
    return [s.output_ids for s in seqs]


def test_padding_rows_write_no_live_state(tiny_one, monkeypatch):
    _, _, path = tiny_one
    want = _tokens(path)
    padded = []
    monkeypatch.setattr(ModelRunner, "graph_rows_for", lambda self, b: padded.append(b) or b + 2)
    assert _tokens(path) == want
    assert padded
