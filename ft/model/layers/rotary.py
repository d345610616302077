"""RoPE frequencies of a model's config: plain, linear position interpolation or YaRN (the rope types
Qwen3-Next's and Qwen3.8-Flash-Next's configs use); the engines' models and the whole-sequence reference
share them."""

from __future__ import annotations

import math

import torch

from ft.model.flash_next_config import TextConfig
from ft.model.rope_config import ROPE_TYPES

__all__ = ["rope_frequencies", "rope_inv_freq"]


def rope_frequencies(cfg: TextConfig, rot: int) -> tuple[torch.Tensor, float]:
    """`rope_inv_freq` of a Qwen3.8-Flash-Next text config."""
    return rope_inv_freq(cfg.rope_type, dict(cfg.rope_scaling), cfg.rope_theta, cfg.max_position_embeddings, rot)


def rope_inv_freq(rope_type: str, scaling: dict, theta: float, max_position_embeddings: int,
                  rot: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot / 2] float32, the factor cos and sin are scaled by) of a RoPE over `rot` features.

    "default": theta^(-2i / rot), 1. "linear" (position interpolation): those divided by `factor`, 1.
    "yarn" (arXiv 2309.00071, as transformers computes it): each frequency blends the original
    (extrapolation) and the one divided by `factor` (interpolation) by a linear ramp over the
    dimensions whose wavelength fits between beta_fast and beta_slow rotations in the original context
    (`original_max_position_embeddings`, else `max_position_embeddings`); cos and sin are scaled by
    0.1 ln(factor) + 1 unless the config names the factor. `factor` missing: max_position_embeddings over
    the original context. `scaling`: the rope's parameters (`ft.model.rope_config.rope_fields`). Raises
    ValueError for another rope type."""
    base = theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    if rope_type == "default":
        return 1.0 / base, 1.0
    y = scaling
    if rope_type == "linear":
        return 1.0 / (float(y.get("factor") or 1.0) * base), 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_type {rope_type!r} (FreeToken runs {', '.join(map(repr, ROPE_TYPES))})")
    original = y.get("original_max_position_embeddings", max_position_embeddings)
    factor = y.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = y.get("attention_factor")
    if attention is None:
        attention = (mscale(factor, y["mscale"]) / mscale(factor, y["mscale_all_dim"])
                     if y.get("mscale") and y.get("mscale_all_dim") else mscale(factor))

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength makes `rotations` turns
        return rot * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(y.get("beta_fast") or 32), dim_of(y.get("beta_slow") or 1)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rot // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, float(attention)
