"""Qwen3-Next's norms and partial rotary: the torch references.

The model calls these through the dispatchers (the Triton kernels where they run); their casts
follow transformers' Qwen3-Next so that bf16 rounds the same way (tests/test_oracle.py checks the
model against transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32, returned in x's dtype. x [..., D], weight [D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] -> (rms_norm(residual + x), residual + x); the sum in x's dtype."""
    h = residual + x
    return rms_norm_ref(h, weight, eps), h


GATE_ACTIVATIONS = ("silu", "sigmoid")


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       activation: str = "silu") -> torch.Tensor:
    """weight * rmsnorm(x) * act(gate), normalised before gating, in x's dtype. x, gate [..., D], weight [D].
    act: "silu" (Qwen3-Next) or "sigmoid" (Qwen3.8-Flash-Next's GDN output gate)."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gated_rms_norm: activation {activation!r}, not one of {GATE_ACTIVATIONS}")
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    # NOTE: the product order and casts follow the reference so bf16 rounds the same way.
    g = gate.float()
    return ((weight * y) * (F.silu(g) if activation == "silu" else torch.sigmoid(g))).to(dtype)


def rotary_inv_freq_ref(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies [rotary_dim / 2], float32: theta ** (-2i / rotary_dim)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (theta**exponent)


def rotary_cos_sin_ref(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, R] in dtype (R = 2 * len(inv_freq)); the angles in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_apply_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the first R dims of each head. x [T, H, D]; cos, sin [T, R], R <= D; the rest passes."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated attention's q/k RMSNorm ((1 + w) form, per head) then partial rotary, cos/sin in q's dtype.

    q [T, Hq, D], k [T, Hk, D] (views allowed), q_weight, k_weight [D], positions [T] (integer),
    inv_freq [rotary_dim / 2] float32 -> new q [T, Hq, D], k [T, Hk, D] in q's and k's dtype.
    """
    if rotary_dim != 2 * inv_freq.numel():
        raise ValueError(f"rotary_dim {rotary_dim} does not match {inv_freq.numel()} frequencies")
    cos, sin = rotary_cos_sin_ref(positions, inv_freq, q.dtype)
    q = rotary_apply_ref(rms_norm_ref(q, q_weight, eps), cos, sin)
    k = rotary_apply_ref(rms_norm_ref(k, k_weight, eps), cos, sin)
    return q, k


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  rotary_dim: int, eps: float) -> torch.Tensor:
    """`qk_norm_rope_ref` of one tensor: x [T, H, D] normed ((1 + w) form, per head), then its first
    rotary_dim dims rotated at positions [T], cos/sin in x's dtype -> new x [T, H, D]."""
    if rotary_dim != 2 * inv_freq.numel():
        raise ValueError(f"rotary_dim {rotary_dim} does not match {inv_freq.numel()} frequencies")
    cos, sin = rotary_cos_sin_ref(positions, inv_freq, x.dtype)
    return rotary_apply_ref(rms_norm_ref(x, weight, eps), cos, sin)
