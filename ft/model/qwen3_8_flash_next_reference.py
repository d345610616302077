"""Qwen3.8-Flash-Next's language model as one whole-sequence forward in torch: the specification
(docs/qwen3.8-flash-next/) made executable, checked against the public reference implementation
(scratch oracle for now: issue 38), before the engine's model runs it over the paged pools.

No cache, no batching, no kernels: one sequence's logits from its token ids, every layer written out
from its formula. The weights are a dict under the Hugging Face checkpoint's names
(`model.language_model.*`, `lm_head.weight`); `config` is the checkpoint's text config (its field
names and defaults: `TextConfig.from_dict`; RoPE "default" or "yarn": the released config's mRoPE
sections change nothing for text, whose three position axes are equal).
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from ft.kernels.norm import rms_norm_ref
from ft.model.flash_next_config import TextConfig
from ft.model.layers.rotary import rope_frequencies
from ft.model.layers.engram import EngramHashing, PLEWeights, ple_delta
from ft.model.layers.hyper_connection import HyperConnection, expand_streams
from ft.model.layers.qsa import compress_keys, select_tokens, sparse_attention

__all__ = ["TextConfig", "forward_logits", "rope_frequencies"]


def _rope(x: torch.Tensor, positions: torch.Tensor, rot: int, cfg: TextConfig) -> torch.Tensor:
    """Rotate-half RoPE on the first `rot` features of x [T, H, D] at positions [T]; the rest pass."""
    half = rot // 2
    inv, scale = rope_frequencies(cfg, rot)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = (ang.cos() * scale)[:, None, :].to(x.dtype), (ang.sin() * scale)[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)


def _hc(w: dict, prefix: str, c: int, eps: float, write: bool = True) -> HyperConnection:
    return HyperConnection(norm=w[f"{prefix}.hc_norm.weight"], down=w[f"{prefix}.input_mix_weight_down.weight"],
                           up=w[f"{prefix}.input_mix_weight_up.weight"],
                           inject=w[f"{prefix}.block_inject_weight.weight"] if write else None, streams=c, eps=eps)


def _gated_deltanet(x: torch.Tensor, w: dict, p: str, cfg: TextConfig) -> torch.Tensor:
    """x [T, H] -> [T, H]: split projections, causal conv + SiLU, the gated delta rule token by token
    (fp32 state), the fp32 gated norm with a sigmoid gate."""
    t = x.shape[0]
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    qkv = F.linear(x, w[f"{p}.in_proj_qkv.weight"])  # [T, 2 hk dk + hv dv]
    kern = w[f"{p}.conv1d.weight"]  # [C, 1, K]
    qkv = F.silu(F.conv1d(F.pad(qkv.T[None], (kern.shape[-1] - 1, 0)), kern, groups=qkv.shape[1])[0].T)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk).float(), k.reshape(t, hk, dk).float(), v.reshape(t, hv, dv).float()
    z = F.linear(x, w[f"{p}.in_proj_z.weight"]).reshape(t, hv, dv)
    beta = torch.sigmoid(F.linear(x, w[f"{p}.in_proj_b.weight"])).float()
    a = F.linear(x, w[f"{p}.in_proj_a.weight"]).float()
    g = -torch.exp(w[f"{p}.A_log"].float()) * F.softplus(a + w[f"{p}.dt_bias"].float())  # [T, hv]
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    state = torch.zeros(hv, dk, dv)
    out = torch.empty(t, hv, dv)
    for i in range(t):
        state = state * torch.exp(g[i])[:, None, None]
        delta = beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", state, k[i]))
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", state, q[i])
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    normed = normed * w[f"{p}.norm.weight"].float() * torch.sigmoid(z.float())
    return F.linear(normed.to(x.dtype).reshape(t, hv * dv), w[f"{p}.out_proj.weight"])


def _qsa_attention(x: torch.Tensor, w: dict, p: str, cfg: TextConfig) -> torch.Tensor:
    """x [T, H] -> [T, H]: gated attention over the tokens the indexer selects per query."""
    t = x.shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot = int(d * cfg.partial_rotary_factor)
    pos = torch.arange(t)
    qg = F.linear(x, w[f"{p}.q_proj.weight"]).reshape(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    k = F.linear(x, w[f"{p}.k_proj.weight"]).reshape(t, hkv, d)
    v = F.linear(x, w[f"{p}.v_proj.weight"]).reshape(t, hkv, d)
    q = _rope(rms_norm_ref(q, w[f"{p}.q_norm.weight"], cfg.rms_norm_eps), pos, rot, cfg)
    k = _rope(rms_norm_ref(k, w[f"{p}.k_norm.weight"], cfg.rms_norm_eps), pos, rot, cfg)
    hi, di, ratio = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    iqk = F.linear(x, w[f"{p}.indexer.index_qk_proj.weight"])
    iq = _rope(rms_norm_ref(iqk[:, : hi * di].reshape(t, hi, di), w[f"{p}.indexer.q_layernorm.weight"], cfg.rms_norm_eps),
               pos, rot, cfg)
    kc = compress_keys(iqk[:, hi * di:], ratio)  # [P, di]
    kc = _rope(rms_norm_ref(kc, w[f"{p}.indexer.k_layernorm.weight"], cfg.rms_norm_eps)[:, None, :],
               torch.arange(kc.shape[0]) * ratio, rot, cfg)[:, 0]
    tokens = select_tokens(iq, kc, pos, cfg.indexer_budget // ratio, ratio)
    o = sparse_attention(q, k, v, tokens, d ** -0.5).reshape(t, hq * d)
    return F.linear(o * torch.sigmoid(gate), w[f"{p}.o_proj.weight"])


def _moe(x: torch.Tensor, w: dict, p: str, cfg: TextConfig) -> torch.Tensor:
    """x [T, H] -> [T, H]: softmax (fp32) over every expert, top-k, renormalised; SwiGLU experts
    (gate_up [E, 2I, H]: gate rows first), the router weight before down; the sigmoid-gated shared expert."""
    probs = torch.softmax(F.linear(x, w[f"{p}.gate.weight"]).float(), dim=-1)
    top, idx = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    gate_up, down = w[f"{p}.experts.gate_up_proj"], w[f"{p}.experts.down_proj"]
    inter = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for i in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[i, j])
            h = gate_up[e] @ x[i]
            act = F.silu(h[:inter]) * h[inter:] * top[i, j].to(x.dtype)
            out[i] += (down[e] @ act).float()
    shared = F.linear(F.silu(F.linear(x, w[f"{p}.shared_expert.gate_proj.weight"]))
                      * F.linear(x, w[f"{p}.shared_expert.up_proj.weight"]), w[f"{p}.shared_expert.down_proj.weight"])
    shared = shared * torch.sigmoid(F.linear(x, w[f"{p}.shared_expert_gate.weight"]))
    return out.to(x.dtype) + shared


def forward_logits(ids: torch.Tensor, weights: dict[str, torch.Tensor], cfg: TextConfig,
                   hashing: EngramHashing | None = None) -> torch.Tensor:
    """ids [T] of one sequence -> logits [T, vocab] (float32), every position.

    `hashing` is required when the config has a PLE layer (its table under
    `...layers.{i}.ple.ple_embedding.ngram_embedding.weight`, rows as `EngramHashing` addresses them)."""
    root = "model.language_model"
    c, eps = cfg.hc_count, cfg.rms_norm_eps
    x = expand_streams(F.embedding(ids, weights[f"{root}.embed_tokens.weight"]), c)
    for i in range(cfg.num_hidden_layers):
        p = f"{root}.layers.{i}"
        if (i + 1) in cfg.ple_layer_ids:
            if hashing is None:
                raise ValueError(f"layer {i} has a PLE layer: pass its EngramHashing")
            rows, _ = hashing.rows(ids)
            emb = F.embedding(rows, weights[f"{p}.ple.ple_embedding.ngram_embedding.weight"]).reshape(ids.shape[0], -1)
            ple = {k: weights[f"{p}.ple.{k}.weight"]
                   for k in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")}
            pw = PLEWeights(key_proj=ple["key_proj"], value_proj=ple["value_proj"], norm_key=ple["norm_key"],
                            norm_query=ple["norm_query"], norm_conv=ple["norm_conv"], conv=ple["conv1d"][:, 0],
                            streams=c, dilation=cfg.ngram_size, eps=eps)
            delta, _ = ple_delta(emb.to(x.dtype), x.reshape(x.shape[0], c, -1), pw)
            x = x + delta
        hc = _hc(weights, f"{p}.attn_hyper_connection", c, eps)
        u, gates = hc.read(x)
        y = (_qsa_attention(u, weights, f"{p}.self_attn", cfg) if cfg.is_attention(i)
             else _gated_deltanet(u, weights, f"{p}.linear_attn", cfg))
        x = hc.write(y, x, gates)
        hc = _hc(weights, f"{p}.mlp_hyper_connection", c, eps)
        u, gates = hc.read(x)
        x = hc.write(_moe(u, weights, f"{p}.mlp", cfg), x, gates)
    h, _ = _hc(weights, f"{root}.hyper_connection_mixer", c, eps, write=False).read(x)
    return F.linear(h, weights["lm_head.weight"]).float()
