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
from bench.cuda_engine_check import SMALL_BF16_CONFIG
from ft.engine import LLM
from ft.engine.sampling_params import SamplingParams

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
    path.write_text(json.dumps(SMALL_BF16_CONFIG))
    f32 = last_logits(path, "float32", False)
    b16 = last_logits(path, "bfloat16", False)
    b16_moe32 = last_logits(path, "bfloat16", True)
    print(f"{'comparison of last logits (reference kernels, CPU)':<52} {'rel L2':>8}")
    print(f"{'bf16 vs fp32':<52} {rel(b16, f32):>8.3f}")
    print(f"{'bf16 with the MoE in fp32 vs bf16':<52} {rel(b16_moe32, b16):>8.3f}")
    print(f"{'bf16 with the MoE in fp32 vs fp32':<52} {rel(b16_moe32, f32):>8.3f}")


if __name__ == "__main__":
    main()
