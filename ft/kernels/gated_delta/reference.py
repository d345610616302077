"""Gated delta rule (Gated DeltaNet's token mixer): torch references.

Recurrence per value head (state S is [Dk, Dv], float32):
    S <- S * exp(g_t)
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t
with q and k L2-normalised and q scaled by Dk**-0.5 (done here, as in the reference models).
The chunked form computes the same thing with matrix products over chunks of `chunk_size`
tokens (the UT transform of the delta rule), which is what prefill uses.
`gated_delta_decode_ref` is the model's whole decode step over the mamba pool's slots (the conv with
its rolling state, the gates, one recurrent step), composed from these references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.kernels.conv1d.reference import causal_conv1d_ref


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat q/k heads to the value heads (head h serves values h*r .. h*r+r-1), normalise."""
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    q = _l2norm(q.float())
    k = _l2norm(k.float())
    return q * (q.shape[-1] ** -0.5), k


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule for a batch of sequences.

    Args:
        q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (log decay, <= 0), beta: [B, T, Hv].
        state: [B, Hv, Dk, Dv] float32, the state before the first token (not modified).
    Returns:
        (o [B, T, Hv, Dv] in v's dtype, new state [B, Hv, Dk, Dv] float32).
    """
    hv = v.shape[-2]
    q, k = _prepare(q, k, hv)
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        u = (v[:, t] - kv_mem) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule; same contract as `recurrent_gated_delta_rule_ref`."""
    b, t, _, _ = q.shape
    hv, dv = v.shape[-2:]
    q, k = _prepare(q, k, hv)
    # [B, H, T, D] in float32, padded to whole chunks (padding has beta = g = 0: no effect).
    q, k, v = (x.transpose(1, 2) for x in (q, k, v.float()))
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)
    pad = (chunk_size - t % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk_size
    q, k, v = (x.reshape(b, hv, n, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(b, hv, n, chunk_size) for x in (g, beta))

    gc = g.cumsum(-1)  # log decay from chunk start to each position
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    # (I + L) with L[i, j] = beta_i exp(gc_i - gc_j) k_i.k_j for j < i; the diagonal is taken as 1.
    system = (kb @ k.transpose(-1, -2)) * decay
    u_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(
        system, kb * gc.exp()[..., None], upper=False, unitriangular=True
    )
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    end_decay = gc[..., -1].exp()[..., None, None]

    s = state.float().clone()
    out = torch.empty_like(v)
    for i in range(n):
        u = u_v[:, :, i] - u_s[:, :, i] @ s  # [B, H, C, Dv]
        out[:, :, i] = q_decayed[:, :, i] @ s + qk[:, :, i] @ u
        s = s * end_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, hv, -1, dv)[:, :, :t].transpose(1, 2)
    return out.contiguous(), s


def chunk_gated_delta_rule_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over sequences packed along T, states in a pool (a loop over the sequences).

    Per sequence exactly what the model's per-sequence prefill did: `recurrent_gated_delta_rule_ref`
    for one token, `chunk_gated_delta_rule_ref` for more, its o rounded to v's dtype.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1].
        ssm_state: [S, Hv, Dk, Dv] float32: sequence b's state at slots[b], read and replaced in place.
        cu_seqlens: [B+1]; slots: [B] distinct (both read on the host: syncs on a GPU).
        out: optional o [T, Hv, Dv] in v's dtype (rows past cu_seqlens[-1] left as they are).
    Returns:
        o [T, Hv, Dv] in v's dtype (a sequence of length 0 gives no rows and keeps its state).
    """
    cu, slot_list = cu_seqlens.tolist(), slots.tolist()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    for b, slot in enumerate(slot_list):
        sl = slice(cu[b], cu[b + 1])
        if sl.stop == sl.start:
            continue
        rule = recurrent_gated_delta_rule_ref if sl.stop - sl.start == 1 else chunk_gated_delta_rule_ref
        ob, new_state = rule(q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl],
                             ssm_state[slot:slot + 1])
        o[sl] = ob[0].to(v.dtype)
        ssm_state[slot] = new_state[0]
    return o


def gated_delta_decode_ref(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of Gated DeltaNet's token mixer (one new token per sequence), the model's math.

    Composed from `causal_conv1d_ref` and `recurrent_gated_delta_rule_ref` exactly as
    `GatedDeltaNet._mix` composes them (bitwise the same). Updates the states at the slots in place.

    Args:
        mixed: [B, C] the new tokens' q, k, v channels before the conv, C = 2 * Hk * Dk + Hv * Dv
            (q of every key head, then k, then v; each head contiguous).
        b, a: [B, Hv] the beta and decay projections.
        conv_state: [S, C, W-1] (any strides) and ssm_state: [S, Hv, Dk, Dv] float32 (any strides):
            the layer's views of the mamba pool, read and written at slots.
        weight: [C, W] the conv weight; a_log, dt_bias: [Hv].
        slots: [B] int64, distinct; a negative slot (padding row) reads and writes no state and gives zeros.
    Returns:
        o [B, Hv, Dv] in mixed's dtype.
    """
    bsz = mixed.shape[0]
    hv, dk, dv = ssm_state.shape[1:]
    kd = (mixed.shape[1] - hv * dv) // 2
    valid = slots >= 0
    if not bool(valid.all()):  # padding rows (syncs: the reference is not for CUDA graphs)
        o = torch.zeros(bsz, hv, dv, dtype=mixed.dtype, device=mixed.device)
        keep = valid.nonzero()[:, 0]
        o[keep] = gated_delta_decode_ref(mixed[keep], b[keep], a[keep], conv_state, ssm_state, weight, a_log,
                                         dt_bias, slots[keep])
        return o
    y, conv_new = causal_conv1d_ref(mixed[:, None], conv_state[slots], weight)  # y [B, 1, C]
    q, k, v = torch.split(y, [kd, kd, hv * dv], dim=-1)
    q = q.reshape(bsz, 1, kd // dk, dk)
    k = k.reshape(bsz, 1, kd // dk, dk)
    v = v.reshape(bsz, 1, hv, dv)
    beta = b[:, None].sigmoid()
    g = -a_log.float().exp() * F.softplus(a[:, None].float() + dt_bias)
    o, ssm_new = recurrent_gated_delta_rule_ref(q, k, v, g, beta, ssm_state[slots])
    conv_state[slots], ssm_state[slots] = conv_new, ssm_new
    return o[:, 0].to(mixed.dtype)
