"""Cutting a Qwen3-Next checkpoint for tensor parallelism: each rank's config and tensors.

Megatron's split, per layer: the column-parallel projections (attention's q/k/v, Gated DeltaNet's
in_proj_qkvz / in_proj_ba, every MLP's gate and up) keep the rows of the rank's heads or
intermediate channels; the row-parallel ones (o_proj, out_proj, every down_proj) keep the matching
columns, so that each rank's output is a partial sum and one all-reduce after the mixer and one
after the MLP restore the full activation. What is per head stays per head (q/k norms, the gated
norm, A_log, dt_bias of the rank's value heads); routers, norms and embeddings are whole on every
rank (the router's top-k must be the same everywhere).

The vocabulary is split too when the size divides it: each rank embeds the token ids in its slice
(zeros elsewhere, summed by an all-reduce) and computes the logits of its slice (gathered on rank
0): every logit is the same dot product as on one GPU.

Heads: rank r owns query heads [r Hq/w, (r+1) Hq/w) and the KV heads those use (KV heads are
split when w divides them, else each is repeated on the ranks whose query heads read it, as
vLLM does); likewise value heads of the linear attention and their key heads. Experts keep all
of their rows' experts: each rank caches its half of every expert (`shard_expert_layer`, cut as the
loader reads each expert).

NVFP4 weights are cut as stored: rows carry their block scales; a column cut must fall on a
16-element block boundary (said in one line when it does not).
"""

from __future__ import annotations

import torch

from ft.errors import ConfigError
from ft.model.config import ModelConfig
from ft.model.layers.linear import NVFP4Weight
from ft.model.tp_split import heads_of as _heads

NVFP4_BLOCK = 16


# ------------------------------------------------------------------------------- cutting tensors
def _rows(t, index: list[int]):
    idx = torch.tensor(index, dtype=torch.long, device=_device_of(t))
    if isinstance(t, NVFP4Weight):
        return NVFP4Weight(t.packed.index_select(0, idx), t.scale.index_select(0, idx), t.scale_2)
    return t.index_select(0, idx)


def _cols(t, lo: int, hi: int, name: str):
    if isinstance(t, NVFP4Weight):
        if lo % NVFP4_BLOCK or hi % NVFP4_BLOCK:
            raise ConfigError(f"{name}: the tensor-parallel cut at columns {lo}:{hi} splits an NVFP4 block of "
                              f"{NVFP4_BLOCK}")
        return NVFP4Weight(t.packed[:, lo // 2 : hi // 2].contiguous(),
                           t.scale[:, lo // NVFP4_BLOCK : hi // NVFP4_BLOCK].contiguous(), t.scale_2)
    return t[:, lo:hi].contiguous()


def _device_of(t) -> torch.device:
    return t.packed.device if isinstance(t, NVFP4Weight) else t.device


def _ranges(*spans: tuple[int, int]) -> list[int]:
    return [i for lo, hi in spans for i in range(lo, hi)]


def shard_tensors(tensors: dict, cfg: ModelConfig, rank: int, world: int) -> dict:
    """The resident tensors of rank `rank` (names unchanged, shapes those of `local_config`).
    Tensors not named here (norms, routers) are whole on every rank; the embedding and the lm_head
    keep the rank's vocabulary rows when `world` divides the vocabulary, else the embedding is
    whole and only rank 0 keeps the lm_head."""
    if world == 1:
        return tensors
    out = dict(tensors)
    a = _heads(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world, "attention")
    lin = _heads(cfg.linear_num_value_heads, cfg.linear_num_key_heads, rank, world, "linear-attention value")
    d, dk, dv = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd = cfg.linear_key_dim
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            s = p + "self_attn."
            out[s + "q_proj.weight"] = _rows(tensors[s + "q_proj.weight"], _ranges((2 * d * a.lo, 2 * d * a.hi)))
            for n in ("k_proj.weight", "v_proj.weight"):
                out[s + n] = _rows(tensors[s + n], _ranges((d * a.klo, d * a.khi)))
            out[s + "o_proj.weight"] = _cols(tensors[s + "o_proj.weight"], d * a.lo, d * a.hi, s + "o_proj")
        else:
            s = p + "linear_attn."
            gv = lin.g
            block = 2 * dk + 2 * gv * dv  # rows of one key head's group in in_proj_qkvz
            qkvz, ba = [], []
            for kh in range(lin.klo, lin.khi):
                vlo, vhi = max(lin.lo, kh * gv) - kh * gv, min(lin.hi, (kh + 1) * gv) - kh * gv  # within the group
                base = kh * block
                qkvz += _ranges((base, base + 2 * dk),
                                (base + 2 * dk + vlo * dv, base + 2 * dk + vhi * dv),
                                (base + 2 * dk + gv * dv + vlo * dv, base + 2 * dk + gv * dv + vhi * dv))
                ba += _ranges((kh * 2 * gv + vlo, kh * 2 * gv + vhi), (kh * 2 * gv + gv + vlo, kh * 2 * gv + gv + vhi))
            out[s + "in_proj_qkvz.weight"] = _rows(tensors[s + "in_proj_qkvz.weight"], qkvz)
            out[s + "in_proj_ba.weight"] = _rows(tensors[s + "in_proj_ba.weight"], ba)
            conv = _ranges((dk * lin.klo, dk * lin.khi), (kd + dk * lin.klo, kd + dk * lin.khi),
                           (2 * kd + dv * lin.lo, 2 * kd + dv * lin.hi))
            out[s + "conv1d.weight"] = _rows(tensors[s + "conv1d.weight"], conv)
            out[s + "out_proj.weight"] = _cols(tensors[s + "out_proj.weight"], dv * lin.lo, dv * lin.hi, s + "out_proj")
            for n in ("A_log", "dt_bias"):
                out[s + n] = tensors[s + n][lin.lo : lin.hi].contiguous()
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            _shard_mlp(out, tensors, m + "shared_expert.", cfg.shared_expert_intermediate_size, rank, world)
        else:
            _shard_mlp(out, tensors, m, cfg.intermediate_size, rank, world)
    v = cfg.vocab_size
    if v % world == 0:  # vocab-parallel: each rank embeds and projects its slice of the vocabulary
        lo, hi = rank * v // world, (rank + 1) * v // world
        out["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][lo:hi].contiguous()
        if "lm_head.weight" in tensors:
            out["lm_head.weight"] = _rows(tensors["lm_head.weight"], _ranges((lo, hi)))
    elif rank != 0:  # whole on every rank; the logits on rank 0 only
        out.pop("lm_head.weight", None)
    return out


def _shard_mlp(out: dict, tensors: dict, prefix: str, inter: int, rank: int, world: int) -> None:
    lo, hi = rank * inter // world, (rank + 1) * inter // world
    for n in ("gate_proj.weight", "up_proj.weight"):
        out[prefix + n] = _rows(tensors[prefix + n], _ranges((lo, hi)))
    out[prefix + "down_proj.weight"] = _cols(tensors[prefix + "down_proj.weight"], lo, hi, prefix + "down_proj")


def expert_rows(inter: int, rank: int, world: int) -> list[int]:
    """Rows of a routed expert's stacked gate/up projection ([gate; up], 2I rows) that rank keeps."""
    lo, hi = rank * inter // world, (rank + 1) * inter // world
    return _ranges((lo, hi), (inter + lo, inter + hi))


def shard_expert_layer(w13: torch.Tensor, s13: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                       rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One rank's part of stacked experts [..., 2I, H(/2)] / [..., H, I(/2)] (NVFP4 with scales, or
    dense with None): gate and up rows of its intermediate channels, down's matching columns."""
    if world == 1:
        return w13, s13, w2, s2
    nvfp4 = s13 is not None
    inter = s2.shape[-1] * NVFP4_BLOCK if nvfp4 else w2.shape[-1]
    rows = torch.tensor(expert_rows(inter, rank, world), dtype=torch.long, device=w13.device)
    lo, hi = rank * inter // world, (rank + 1) * inter // world
    if nvfp4 and (lo % NVFP4_BLOCK or hi % NVFP4_BLOCK):
        raise ConfigError(f"the routed experts' down_proj cut at columns {lo}:{hi} splits an NVFP4 block of "
                          f"{NVFP4_BLOCK}")
    w13 = w13.index_select(-2, rows)
    w2 = w2[..., lo // 2 : hi // 2] if nvfp4 else w2[..., lo:hi]
    if nvfp4:
        s13 = s13.index_select(-2, rows)
        s2 = s2[..., lo // NVFP4_BLOCK : hi // NVFP4_BLOCK]
    return w13.contiguous(), None if s13 is None else s13.contiguous(), w2.contiguous(), \
        None if s2 is None else s2.contiguous()
