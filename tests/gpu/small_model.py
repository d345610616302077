"""The small synthetic model most device tests build (the `model` fixture of tests/gpu/conftest.py)."""

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
