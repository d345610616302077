"""How sensitive are the synthetic benchmark model's logits to bf16 rounding? (kernels issue). Not a test.

    PYTHONPATH=. python bench/bf16_sensitivity.py      (CPU, a few seconds)

bench/cuda_engine_check.py saw a 13% last-logit gap between the engine's Triton path and its
torch-reference path on a random 4-layer bf16 model (greedy tokens identical). This runs the
torch references on the same geometry three ways: fp32, bf16, and bf16 with the MoE computed in
fp32 (which is where the Triton kernels keep their intermediate values), and prints the gaps.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import torch

import ft.kernels.moe as moe_mod
from ft.engine import LLM
from ft.engine.sampling_params import SamplingParams

CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 1024, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 32,
    "num_experts_per_tok": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}  # the geometry of bench/cuda_engine_check.py
PROMPT = list(range(100, 164))
_REF_MOE = moe_mod.moe_over_slots_ref


def _moe_in_fp32(x, topk_slots, topk_weights, w):
    return _REF_MOE(x.float(), topk_slots, topk_weights.float(), w).to(x.dtype)


def last_logits(config_path: pathlib.Path, dtype: str, fp32_moe: bool) -> torch.Tensor:
    moe_mod.moe_over_slots_ref = _moe_in_fp32 if fp32_moe else _REF_MOE
    try:
        llm = LLM(model=f"synthetic:{config_path}", device="cpu", dtype=dtype, moe_cache_size=24, num_tokens=1024,
                  gpu_memory_limit="2GiB")
        e = llm.engine
        seq = e.add_request(PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        while not seq.output_ids:
            e.step()
        return e.last_logits[0].float().clone()
    finally:
        moe_mod.moe_over_slots_ref = _REF_MOE


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(CONFIG))
    f32 = last_logits(path, "float32", False)
    b16 = last_logits(path, "bfloat16", False)
    b16_moe32 = last_logits(path, "bfloat16", True)
    print(f"{'comparison of last logits (reference kernels, CPU)':<52} {'rel L2':>8}")
    print(f"{'bf16 vs fp32':<52} {rel(b16, f32):>8.3f}")
    print(f"{'bf16 with the MoE in fp32 vs bf16':<52} {rel(b16_moe32, b16):>8.3f}")
    print(f"{'bf16 with the MoE in fp32 vs fp32':<52} {rel(b16_moe32, f32):>8.3f}")


if __name__ == "__main__":
    main()
