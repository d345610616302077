"""Qwen3-Next with a scaled RoPE (YaRN, linear interpolation), as its model card extends the context:
the frequencies against transformers' own, the engine's logits and greedy tokens against transformers'
model; an unsupported rope type refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_CONFIGS, make_hf_model, save_checkpoint
from test_oracle import GREEDY_32, first_step_logits, hf_greedy, hf_last_logits, make_llm, prompt_of, rel_err

from ft.errors import UnsupportedModelError
from ft.model.config import ModelConfig
from ft.model.layers.rotary import rope_inv_freq
from ft.model.rope_config import rope_fields

BASE = TINY_CONFIGS["interval2-gqa2-top2"]
# the tiny model's context is 512 tokens; "original" contexts of 32-64 put the prompts past them, where the
# scaled frequencies matter
ROPES = {
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
             "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "factor": 8.0,
                    "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 3.0},
}


def hf_inv_freq(rope: dict, head_dim: int = 16, max_position: int = 512) -> tuple[torch.Tensor, float]:
    """transformers' frequencies and attention factor for a Qwen3-Next config with this rope."""
    from transformers import Qwen3NextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Qwen3NextConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4, max_position_embeddings=max_position,
                          rope_parameters=dict(rope))
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")


@pytest.mark.parametrize("name", sorted(ROPES))
def test_frequencies_match_transformers(name):
    rope = ROPES[name]
    rot = int(16 * rope["partial_rotary_factor"])
    rope_type, scaling = rope_fields(rope)
    ours, scale = rope_inv_freq(rope_type, dict(scaling), rope["rope_theta"], 512, rot)
    theirs, their_scale = hf_inv_freq(rope)
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0), name
    assert scale == pytest.approx(their_scale, rel=1e-6)
    plain, _ = rope_inv_freq("default", {}, rope["rope_theta"], 512, rot)
    assert not torch.allclose(ours, plain)  # (the scaling changes the frequencies: the test can fail)


@pytest.fixture(scope="module", params=sorted(ROPES))
def scaled(request, tmp_path_factory):
    name = request.param
    model = make_hf_model({**BASE, "rope_parameters": ROPES[name]})
    return name, model, save_checkpoint(model, tmp_path_factory.mktemp(f"rope-{name}"))


def test_the_engine_matches_transformers_with_a_scaled_rope(scaled):
    name, model, path = scaled
    prompt = prompt_of(90, seed=4)
    llm = make_llm(path, max_prefill_length=40)  # chunks: later ones rotate at positions past the original context
    logits = first_step_logits(llm, prompt)
    assert rel_err(logits, hf_last_logits(model, prompt)) < 1e-4, name
    assert llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == hf_greedy(model, prompt), name
    # the same weights with plain RoPE give other logits: the rope's parameters were read, not ignored
    cfg = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_dict(cfg).rope_type == ROPES[name]["rope_type"]
    plain = model.__class__(model.config.__class__(**{**model.config.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROPES[name]["partial_rotary_factor"]}}))
    plain.load_state_dict(model.state_dict())
    assert rel_err(hf_last_logits(plain.float().eval(), prompt), logits) > 1e-3


def test_the_older_rope_scaling_field_is_read():
    """Configs before transformers 5 put the rope under `rope_scaling` with `type`."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 262144}}
    got = ModelConfig.from_dict(cfg)
    assert got.rope_type == "yarn"
    assert dict(got.rope_scaling) == {"factor": 4.0, "original_max_position_embeddings": 262144}


@pytest.mark.parametrize(("rope", "max_position", "context"), [
    ({"rope_type": "default"}, 262144, 262144),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}, 262144, 1048576),  # the card's
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 262144}, 524288, 524288),  # pre-extended
    ({"rope_type": "yarn", "factor": 4.0}, 32768, 131072),
    ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
])
def test_the_context_is_the_ropes_as_vllm_derives_it(rope, max_position, context):
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "max_position_embeddings": max_position, "rope_parameters": {"rope_theta": 1e7, **rope}}
    assert ModelConfig.from_dict(cfg).context_length == context


@pytest.mark.parametrize(("rope", "words"), [({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_type 'dynamic'"),
                                             ({"rope_type": "linear"}, "needs a positive factor"),
                                             ({"rope_type": "yarn", "factor": -1.0}, "factor must be positive"),
                                             ({"rope_type": "yarn", "original_max_position_embeddings": 0},
                                              "original_max_position_embeddings must be positive")])
def test_a_rope_the_model_cannot_run_is_refused_in_one_line(rope, words):
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "rope_parameters": {"rope_theta": 10000.0, **rope}}
    with pytest.raises(UnsupportedModelError, match=words) as e:
        ModelConfig.from_dict(cfg)
    assert "\n" not in str(e.value)


def test_model_overrides_turn_yarn_on_as_the_card_says(tmp_path):
    """A checkpoint saved with plain RoPE, served with --hf-overrides '{"rope_scaling": {...yarn}}' (the Qwen3-Next
    card's vLLM line): the same tokens as transformers with that rope on the same weights; the context follows."""
    from ft.engine import LLM
    from ft.engine.base.engine_config import EngineConfig

    rope = ROPES["yarn"]
    plain = make_hf_model({**BASE, "rope_parameters": {k: rope[k] for k in ("rope_type", "rope_theta",
                                                                          "partial_rotary_factor")} | {"rope_type": "default"}})
    path = save_checkpoint(plain, tmp_path / "plain")
    yarn = plain.__class__(plain.config.__class__(**{**plain.config.to_dict(), "rope_parameters": dict(rope)}))
    yarn.load_state_dict(plain.state_dict())
    yarn = yarn.float().eval()
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    overrides = json.dumps({"rope_scaling": scaling, "max_position_embeddings": 512})
    assert EngineConfig(model_overrides=overrides).model_override_fields == {"rope_scaling": scaling,
                                                                           "max_position_embeddings": 512}
    llm = make_llm(path, max_prefill_length=40, model_overrides=overrides)
    prompt = prompt_of(90, seed=4)
    assert rel_err(first_step_logits(llm, prompt), hf_last_logits(yarn, prompt)) < 1e-4
    assert llm.generate(prompt_token_ids=[prompt], **GREEDY_32)[0].token_ids == hf_greedy(yarn, prompt)
    assert isinstance(llm, LLM) and llm.engine.model_config.rope_type == "yarn"
    from ft.serve_cmd import describe  # the banner says which rope runs (the override took effect)

    first = describe(llm.engine, "http://x").splitlines()[0]
    assert first.endswith("context 512 tokens (RoPE yarn, factor 4 over 32 tokens)"), first


def test_overrides_merge_into_dicts_and_reach_rope_parameters():
    from ft.model.config import merge_overrides

    cfg = {"a": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
           "text_config": {"b": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}}
    got = merge_overrides(cfg, {"a": 5, "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
                                "text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "c": 3}})
    assert got["a"] == 5 and got["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e7, "factor": 2.0}
    assert got["text_config"]["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    assert got["text_config"]["b"] == 2 and got["text_config"]["c"] == 3
    assert cfg["a"] == 1 and cfg["rope_parameters"]["rope_type"] == "default"  # the config is not changed
    # an explicit rope_parameters override is taken as given
    got = merge_overrides(cfg, {"rope_parameters": {"factor": 3.0}, "rope_scaling": {"factor": 9.0}})
    assert got["rope_parameters"]["factor"] == 3.0


@pytest.mark.parametrize(("text", "words"), [("{not json", "--model-overrides: not JSON"),
                                             ("[1, 2]", "a JSON object of config.json fields is needed")])
def test_bad_model_overrides_are_one_line(text, words):
    from ft.engine.base.engine_config import EngineConfig
    from ft.errors import ConfigError

    with pytest.raises(ConfigError, match=words) as e:
        EngineConfig(model_overrides=text)
    assert "\n" not in str(e.value)
