"""An NVFP4 checkpoint and its oracle: `ft quantize` applied to a tiny random checkpoint, and the
transformers model of the original with every quantized projection replaced by its dequantized
weight (shared by tests/test_nvfp4_oracle.py and tests/gpu; no environment side effects)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from ft.kernels.nvfp4 import dequantize_nvfp4
from ft.tools.quantize_checkpoint import quantize_checkpoint


def quantized_pair(src, tmp_path_factory):
    """(transformers model on the dequantized weights, float32, eval; the NVFP4 checkpoint's path)."""
    dst = tmp_path_factory.mktemp("nvfp4") / "ck"
    quantize_checkpoint(src, dst, progress=False)
    # transformers on the dequantized weights: the oracle for the quantized checkpoint
    from transformers import Qwen3NextForCausalLM

    ref = Qwen3NextForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    params = dict(ref.named_parameters())
    n_quantized = 0
    with safe_open(str(dst / "model.safetensors"), "pt") as f, torch.no_grad():
        names = set(f.keys())
        for name in names:
            if not name.endswith(".weight_scale"):
                continue
            module = name.removesuffix(".weight_scale")
            w = dequantize_nvfp4(f.get_tensor(module + ".weight"), f.get_tensor(name), f.get_tensor(module + ".weight_scale_2"))
            _assign(ref, params, module, w)
            n_quantized += 1
    assert n_quantized > 20
    return ref, dst


def _assign(model, params, module: str, w: torch.Tensor) -> None:
    """Write a dequantized projection into the transformers model (experts are fused there)."""
    if ".mlp.experts." in module:
        prefix, rest = module.split(".mlp.experts.")
        e, proj = rest.split(".")
        experts = model.get_submodule(prefix + ".mlp.experts")
        i = experts.gate_up_proj.shape[1] // 2
        if proj == "gate_proj":
            experts.gate_up_proj[int(e), :i] = w
        elif proj == "up_proj":
            experts.gate_up_proj[int(e), i:] = w
        else:
            experts.down_proj[int(e)] = w
        return
    params[module + ".weight"].copy_(w)
