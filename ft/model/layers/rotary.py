"""RoPE frequencies of a Qwen3.8-Flash-Next text config: plain, or YaRN (the released config's rope
type); the engine's model and the whole-sequence reference share them."""

from __future__ import annotations

import math

import torch

from ft.model.flash_next_config import TextConfig

__all__ = ["rope_frequencies"]


def rope_frequencies(cfg: TextConfig, rot: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot / 2] float32, the factor cos and sin are scaled by) of the config's RoPE.

    YaRN (arXiv 2309.00071, as transformers computes it): each frequency blends the original
    (extrapolation) and the one divided by `factor` (interpolation) by a linear ramp over the
    dimensions whose wavelength fits between beta_fast and beta_slow rotations in the original context;
    cos and sin are scaled by 0.1 ln(factor) + 1 unless the config names the factor."""
    theta = cfg.rope_theta
    base = theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    if cfg.rope_type == "default":
        return 1.0 / base, 1.0
    y = dict(cfg.rope_scaling)
    original = y.get("original_max_position_embeddings", cfg.max_position_embeddings)
    factor = y.get("factor") or cfg.max_position_embeddings / original

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
