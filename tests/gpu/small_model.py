"""The small synthetic models device tests build: a Qwen3-Next (the `model` fixture of tests/gpu/conftest.py) and an
NVFP4 Qwen3.8-Flash-Next (`small_flash_next`)."""

import json

SMALL_BF16_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 1024, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 32,
    "num_experts_per_tok": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
"""A synthetic Qwen3-Next small enough to build in seconds (4 layers, 32 experts)."""

FLASH_NEXT_CONFIG = "bench/configs/qwen3.8-flash-next-small-table.json"
"""The flagship's synthetic config (read from the repository root, where the device tests run)."""


def small_flash_next(tmp_path, **text) -> str:
    """A small synthetic NVFP4 Qwen3.8-Flash-Next (`bench/configs/qwen3.8-flash-next.json`'s fields,
    smaller), as a model name."""
    flagship = json.loads(open(FLASH_NEXT_CONFIG).read())
    flagship["text_config"].update(dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_experts=32,
                                        hc_lowrank=64, ngram_vocab_size_base=1000, max_position_embeddings=4096,
                                        eos_token_id=2, bos_token_id=2), **text)
    flagship["eos_token_id"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(flagship))
    return f"synthetic:{path}"
