"""Triton kernels for `ft.kernels.activation`: elementwise, one program per (row, column block),
math in fp32 with each op of the reference rounded to the storage dtype where the reference
rounds (so bf16 results differ from torch only by its exp/sigmoid implementation)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["expert_combine_triton", "silu_mul_triton"]

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(p_g, p_u, p_o, N, stride_g, stride_u, stride_o, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_g = tl.load(p_g + i_t * stride_g + o_n, mask=m_n, other=0.0)
    b_u = tl.load(p_u + i_t * stride_u + o_n, mask=m_n, other=0.0)
    b_gf = b_g.to(tl.float32)
    b_s = (b_gf / (1.0 + tl.exp(-b_gf))).to(b_g.dtype)  # silu, rounded as F.silu rounds
    b_o = b_s.to(tl.float32) * b_u.to(tl.float32)
    tl.store(p_o + i_t * stride_o + o_n, b_o.to(p_o.dtype.element_ty), mask=m_n)


@triton.jit
def _expert_combine_kernel(p_r, p_s, p_gl, p_o, N, stride_r, stride_s, stride_gl, stride_o, BLOCK_N: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_r = tl.load(p_r + i_t * stride_r + o_n, mask=m_n, other=0.0)
    b_s = tl.load(p_s + i_t * stride_s + o_n, mask=m_n, other=0.0)
    b_gl = tl.load(p_gl + i_t * stride_gl).to(tl.float32)
    b_g = (1.0 / (1.0 + tl.exp(-b_gl))).to(b_r.dtype).to(tl.float32)  # sigmoid, rounded
    b_sh = (b_s.to(tl.float32) * b_g).to(b_r.dtype)  # shared * gate, rounded
    b_o = b_r.to(tl.float32) + b_sh.to(tl.float32)
    tl.store(p_o + i_t * stride_o + o_n, b_o.to(p_o.dtype.element_ty), mask=m_n)


def _rows(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"expected [T, N] tensors with unit column stride, got {tuple(t.shape)} {t.stride()}")


def _output(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`out`, checked to be [T, N] in like's dtype and device with unit column stride, or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if (out.shape != like.shape or out.dtype != like.dtype or out.device != like.device
            or (out.numel() and out.stride(-1) != 1)):
        raise ValueError(f"out must be {tuple(like.shape)} {like.dtype} on {like.device} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} {out.stride()}")
    return out


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, I] (rows may be strided) -> [T, I] in gate's dtype."""
    _rows(gate, up)
    t, n = gate.shape
    if up.shape != gate.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    out = _output(out, gate)
    if t and n:
        grid = (t, triton.cdiv(n, BLOCK))
        _silu_mul_kernel[grid](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK_N=BLOCK, **pdl_args(gate.device))
    return out


def expert_combine_triton(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """routed + shared * sigmoid(gate_logit): routed, shared [T, H], gate_logit [T, 1] -> [T, H]."""
    _rows(routed, shared)
    t, n = routed.shape
    if gate_logit.shape != (t, 1):
        raise ValueError(f"gate_logit must be [T, 1] = [{t}, 1], got {tuple(gate_logit.shape)}")
    if shared.shape != routed.shape:
        raise ValueError(f"routed and shared must have one shape, got {tuple(routed.shape)} and {tuple(shared.shape)}")
    out = _output(out, routed)
    if t and n:
        grid = (t, triton.cdiv(n, BLOCK))
        _expert_combine_kernel[grid](routed, shared, gate_logit, out, n, routed.stride(0), shared.stride(0),
                                     gate_logit.stride(0), out.stride(0), BLOCK_N=BLOCK, **pdl_args(routed.device))
    return out
