"""GPU checks of the Triton path (kernels issue). Not a test.

    PYTHONPATH=. python3 bench/cuda_engine_check.py

1. The fused MoE-over-slots kernel against the torch reference on the flagship's expert shapes
   (hidden 2048, moe_intermediate 512, 10 of 64 resident slots), batch 1 and 8, with timings.
2. The engine end to end on CUDA (a synthetic small Qwen3-Next, bf16): greedy tokens and logits
   through the Triton dispatchers against the same engine forced onto the torch references.
Prints a table last.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import triton.testing

import ft.kernels.moe as moe_mod
import ft.kernels.nvfp4 as nvfp4_mod
from ft.engine import LLM
from ft.kernels.moe import SlotWeights, moe_over_slots, moe_over_slots_ref
from ft.kernels.nvfp4 import quantize_nvfp4


SMALL_BF16_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 1024, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 32,
    "num_experts_per_tok": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
"""A synthetic Qwen3-Next small enough to build in seconds (4 layers, 32 experts): the engine checks' model."""


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def slot_pool(n_slots: int, hidden: int, inter: int) -> SlotWeights:
    w13, s13, w2, s2, g = [], [], [], [], []
    for _ in range(n_slots):
        gate, up, down = (torch.randn(inter, hidden, device="cuda") * 0.02, torch.randn(inter, hidden, device="cuda") * 0.02,
                          torch.randn(hidden, inter, device="cuda") * 0.02)
        qg, qu, qd = quantize_nvfp4(gate), quantize_nvfp4(up), quantize_nvfp4(down)
        w13.append(torch.cat([qg[0], qu[0]]))
        s13.append(torch.cat([qg[1], qu[1]]))
        w2.append(qd[0])
        s2.append(qd[1])
        g.append(torch.stack([qg[2], qu[2], qd[2]]))
    return SlotWeights(torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2), torch.stack(g))


def moe_rows():
    rows = []
    pool = slot_pool(64, 2048, 512)
    for batch in (1, 8):
        x = torch.randn(batch, 2048, device="cuda", dtype=torch.bfloat16)
        slots = torch.stack([torch.randperm(64, device="cuda")[:10] for _ in range(batch)])
        w = torch.softmax(torch.randn(batch, 10, device="cuda"), -1).to(torch.bfloat16)
        ref = moe_over_slots_ref(x, slots, w, pool)
        got = moe_over_slots(x, slots, w, pool)
        t_tri = triton.testing.do_bench(lambda: moe_over_slots(x, slots, w, pool), return_mode="median") * 1e3
        t_ref = triton.testing.do_bench(lambda: moe_over_slots_ref(x, slots, w, pool), return_mode="median") * 1e3
        experts = len(torch.unique(slots))
        nbytes = experts * (pool.w13[0].numel() + pool.w2[0].numel() + pool.w13_scale[0].numel() + pool.w2_scale[0].numel())
        rows.append((f"fused MoE, 10 experts, batch {batch}", rel(got, ref), t_tri, t_ref, nbytes / t_tri / 1e3))
    return rows


def engine_rows():
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(SMALL_BF16_CONFIG))
    prompt = list(range(100, 164))
    out = {}
    for mode in ("triton", "reference"):
        if mode == "reference":
            nvfp4_mod._use_triton = lambda x: False
            moe_mod._use_triton = lambda x: False
        llm = LLM(model=f"synthetic:{path}", device="cuda", dtype="bfloat16", moe_cache_size=24, num_tokens=1024)
        e = llm.engine
        seq = e.add_request(prompt, __import__("ft.engine.sampling_params", fromlist=["x"]).SamplingParams(
            max_new_tokens=1, temperature=0.0, ignore_eos=True))
        while not seq.output_ids:
            e.step()
        logits = e.last_logits[0].clone()
        toks = llm.generate(prompt_token_ids=[prompt], max_new_tokens=16, temperature=0.0, ignore_eos=True)[0].token_ids
        out[mode] = (logits, toks)
    same = sum(a == b for a, b in zip(out["triton"][1], out["reference"][1]))
    return [("engine e2e (bf16, 4 layers, 32 experts)", rel(out["triton"][0], out["reference"][0]), same)]


def main():
    torch.manual_seed(0)
    mrows = moe_rows()
    erows = engine_rows()
    print(f"\n{'check':<42} {'rel RMS vs ref':>14} {'triton us':>10} {'torch ref us':>12} {'GB/s':>8}")
    for name, r, t, tr, gbs in mrows:
        print(f"{name:<42} {r:>14.2e} {t:>10.1f} {tr:>12.1f} {gbs:>8.0f}")
    for name, r, same in erows:
        print(f"{name:<42} {r:>14.2e}   greedy tokens equal to the reference path: {same}/16")


if __name__ == "__main__":
    main()
