"""What a checkpoint's shapes let the kernels do, checked before it loads: each shape no path can run is
refused with one line naming the dimension and what is supported; each shape that takes a slower path
(a torch reference where a Triton kernel would run) gives one line for the startup summary. Torch-free
(`ft serve` checks before it binds its port): the limits come from `ft.kernels.limits`.

Rules (on "cuda": where the dispatchers run Triton, `ft.kernels.backend.uses_triton`; on "cpu" every
dispatcher runs its reference, which takes any size, so only the rules marked "every device" apply):

Refused, config.json's values that no path computes (every device; CheckpointError):
  - sizes below 1: vocab_size, hidden_size, num_hidden_layers, decoder_sparse_step; with full-attention
    layers num_attention_heads, num_key_value_heads, head_dim; with linear-attention layers the
    linear_* head counts and dims; with MoE layers num_experts_per_tok, moe_intermediate_size,
    shared_expert_intermediate_size; with dense MLP layers intermediate_size; num_experts below 0.
  - num_key_value_heads not dividing num_attention_heads (the attention kernels' `Hq % Hkv` check;
    the reference maps query head h to kv head h // (Hq / Hkv)).
  - linear_num_key_heads not dividing linear_num_value_heads (`chunk_kernel`'s and the decode
    kernel's `Hv % Hk`; the layer groups its projection rows by key head).
  - num_experts_per_tok outside 1..num_experts (`route_triton`'s check; torch.topk's).
  - `check_weight_rows`: the heads times head dims against the projections' rows in the weight files.
Refused, shapes the kernels do not take (UnsupportedModelError):
  - the rotary dim int(head_dim x partial_rotary_factor) odd or above head_dim (every device: the
    reference's frequencies and rotate-half need pairs), or 0 on cuda (`qk_norm_rope_triton`: 2..D).
  - linear_conv_kernel_dim below CONV_MIN_WIDTH = 2 (every device: the conv kernels' check; the
    reference's state slice needs W - 1 >= 1).
  - NVFP4 weights (`quantized`, every device): every projection's K (hidden_size,
    moe_intermediate_size, shared_expert_intermediate_size, intermediate_size where dense MLP layers
    exist, Hq x head_dim for o_proj, Hv x Dv for out_proj) a multiple of NVFP4_BLOCK = 16 (the format;
    the NVFP4 and MoE kernels check it too). The exclusions are not read: ModelOpt's leave only
    projections of K = hidden_size dense (routers, gates, lm_head, in_proj_ba); a checkpoint that left
    others dense would be checked as if they were NVFP4.
  - an NVFP4 KV cache (`kv_nvfp4`, every device): head_dim a multiple of NVFP4_BLOCK = 16.
  - head_dim above ATTENTION_MAX_HEAD_DIM = 256 (cuda: the decode and prefill kernels raise; the
    dispatchers have no fallback).
  - the prefill attention tile above PREFILL_MAX_TILE (cuda): max(128, next_pow2(Hq / Hkv)) rows x
    max(16, next_pow2(head_dim)) columns; past it the launch runs out of shared memory.
  - hidden_size above NORM_MAX_D = 8192 with NVFP4 experts whose shared expert has their width (cuda:
    the decode MoE block then applies the next layer's norm with `add_rms_norm_triton`, which raises;
    under tensor parallelism it does not, which this check does not tell apart).
Reference paths (cuda; lines returned for the startup summary):
  - linear_key_head_dim above GATED_DELTA_MAX_DK = 256: Gated DeltaNet prefill and decode run the
    references (the decode reference reads the slots on the host: no decode CUDA graphs).
  - linear_value_head_dim above 256: Gated DeltaNet prefill runs the reference (no prefill graphs);
    above NORM_MAX_D the gated RMSNorm runs its reference too.
  - hidden_size above NORM_MAX_D (not refused above): the RMSNorms run the reference.
  - num_experts above ROUTER_MAX_EXPERTS = 8192: the router runs the reference.
  - read-through offloaded decode (`read_through`) with NVFP4 experts whose hidden_size or
    moe_intermediate_size is not a power of two 16..8192 (K / 8 up to WHOLE_K_MAX_WORDS words in one
    tile): `moe_decode_triton` raises for the host store, so the engine loads missing experts before
    each step instead (`read_through_refusal`).
Not rules: the dense GEMV's `DenseOptions.max_m` / MAX_N / K % 16 (past them cuBLAS runs, as fast); GQA groups in
decode attention (measured to 256 at head_dim 256); the gated delta decode kernel's Dv (any, in blocks).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ft.errors import CheckpointError, UnsupportedModelError
from ft.kernels.limits import (
    ATTENTION_MAX_HEAD_DIM, CONV_MIN_WIDTH, GATED_DELTA_MAX_DK, NORM_MAX_D, NVFP4_BLOCK, PREFILL_MAX_TILE,
    ROUTER_MAX_EXPERTS, WHOLE_K_MAX_WORDS, whole_k_pieces,
)
from ft.model.config import ModelConfig

__all__ = ["check_kernel_shapes", "check_weight_rows", "nvfp4_formats", "read_through_refusal"]


def check_kernel_shapes(cfg: ModelConfig, *, device_type: str, quantized: bool, kv_nvfp4: bool = False,
                        read_through: bool = False) -> list[str]:
    """Refuse what no path runs (CheckpointError for values no model has, UnsupportedModelError for
    shapes the kernels do not take: one line, the first rule broken); return the lines of the shapes
    that take a slower path (empty off "cuda").

    device_type: "cuda" where the dispatchers run Triton, else "cpu" (the references everywhere).
    quantized: the projections and routed experts are NVFP4. kv_nvfp4: the KV cache is NVFP4.
    read_through: offloaded decode reads missing experts through (`--expert-read-through`)."""
    triton = device_type == "cuda"
    for why in _invalid(cfg):
        raise CheckpointError(f"config.json: {why}")
    for why in _unsupported(cfg, triton, quantized, kv_nvfp4):
        raise UnsupportedModelError(why)
    return list(_reference_paths(cfg, quantized, read_through)) if triton else []


def read_through_refusal(cfg: ModelConfig, *, quantized: bool) -> str | None:
    """Why read-through offloaded decode cannot run this model on CUDA (None: it can): the NVFP4 decode
    MoE kernels read an expert from the host store only with a row's whole K in one or two tiles
    (`limits.whole_k_pieces`), for hidden_size (gate/up) and moe_intermediate_size (down)."""
    if not (quantized and cfg.moe_layers):
        return None
    bad = [f"{name} {k}" for name, k in (("hidden_size", cfg.hidden_size), ("moe_intermediate_size",
                                                                          cfg.moe_intermediate_size))
           if not _whole_k(k)]
    if not bad:
        return None
    return (f"{' and '.join(bad)}: read-through decode takes K / 8 = 2^a or 2^a + 2^b "
            f"(2 <= 2^b < 2^a <= {WHOLE_K_MAX_WORDS}: 2,560 and 640 are)")


def nvfp4_formats(quantization: dict) -> tuple[bool, bool]:
    """(weights NVFP4, KV cache scales NVFP4) of a checkpoint's quantization settings
    (`ft.model.config.read_quantization`; the checkpoint reader refuses other algorithms)."""
    algo = quantization.get("quant_algo") or quantization.get("quant_method")
    kv = quantization.get("kv_cache_quant_algo")
    return str(algo).upper() == "NVFP4", str(kv).upper() == "NVFP4"


def check_weight_rows(cfg: ModelConfig, model_dir: str | Path) -> None:
    """Refuse (CheckpointError, one line) heads x head dims that do not match the weights' rows, read
    from the safetensors headers (no tensor is read): the first full-attention layer's q_proj (2 x Hq x
    head_dim: q and its gate) and k_proj (Hkv x head_dim), the first linear-attention layer's
    in_proj_qkvz (2 x Hk x Dk + 2 x Hv x Dv) and in_proj_ba (2 x Hv). Rows, not columns: NVFP4 packs
    columns. A tensor it cannot find is left to the loader, which checks every shape."""
    checks = []
    if cfg.full_attention_layers:
        p, hq, hkv, d = (f"model.layers.{cfg.full_attention_layers[0]}.self_attn.", cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim)
        heads = f"num_attention_heads {hq}, num_key_value_heads {hkv}, head_dim {d}"
        checks += [(p + "q_proj.weight", 2 * hq * d, f"2 x {hq} x {d}", heads),
                   (p + "k_proj.weight", hkv * d, f"{hkv} x {d}", heads)]
    if cfg.linear_attention_layers:
        p = f"model.layers.{cfg.linear_attention_layers[0]}.linear_attn."
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        heads = f"linear_num_key_heads {hk} of {dk}, linear_num_value_heads {hv} of {dv}"
        checks += [(p + "in_proj_qkvz.weight", 2 * hk * dk + 2 * hv * dv, f"2 x {hk} x {dk} + 2 x {hv} x {dv}", heads),
                   (p + "in_proj_ba.weight", 2 * hv, f"2 x {hv}", heads)]
    shapes = _header_shapes(Path(model_dir), [name for name, *_ in checks])
    for name, rows, formula, heads in checks:
        found = shapes.get(name)
        if found and found[0] != rows:
            raise CheckpointError(f"config.json: {heads} do not match the weights: {name} has {found[0]} rows, "
                                  f"the config gives {formula} = {rows}")


# ----------------------------------------------------------------------------- the rules
def _invalid(cfg: ModelConfig) -> Iterator[str]:
    sizes = ["vocab_size", "hidden_size", "num_hidden_layers", "decoder_sparse_step"]
    if cfg.full_attention_layers:
        sizes += ["num_attention_heads", "num_key_value_heads", "head_dim"]
    if cfg.linear_attention_layers:
        sizes += ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"]
    for name in sizes:
        if getattr(cfg, name) < 1:
            yield f"{name} {getattr(cfg, name)} must be at least 1"
    if cfg.num_experts < 0:
        yield f"num_experts {cfg.num_experts} must be at least 0"
    if cfg.moe_layers:  # (decoder_sparse_step >= 1 by now: it sets which layers these are)
        for name in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(cfg, name) < 1:
                yield f"{name} {getattr(cfg, name)} must be at least 1 (the model has MoE layers)"
    if _has_dense_mlp(cfg) and cfg.intermediate_size < 1:
        yield f"intermediate_size {cfg.intermediate_size} must be at least 1 (the model has dense MLP layers)"
    if cfg.full_attention_layers and cfg.num_attention_heads % cfg.num_key_value_heads:
        yield (f"num_key_value_heads {cfg.num_key_value_heads} does not divide num_attention_heads "
               f"{cfg.num_attention_heads}: each key/value head serves a whole group of query heads")
    if cfg.linear_attention_layers and cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        yield (f"linear_num_key_heads {cfg.linear_num_key_heads} does not divide linear_num_value_heads "
               f"{cfg.linear_num_value_heads}: each key head serves a whole group of value heads")
    if cfg.moe_layers and cfg.num_experts_per_tok > cfg.num_experts:
        yield f"num_experts_per_tok {cfg.num_experts_per_tok} is more than num_experts {cfg.num_experts}"


def _unsupported(cfg: ModelConfig, triton: bool, quantized: bool, kv_nvfp4: bool) -> Iterator[str]:
    if cfg.is_flash_next:  # (Qwen3.8-Flash-Next's own fields: HyperConnections, QSA, the PLE layer)
        yield from cfg.flash_next.unsupported(cfg.rotary_dim)
    d = cfg.head_dim
    if cfg.full_attention_layers:
        r, lo = cfg.rotary_dim, 2 if triton else 0
        if r % 2 or not lo <= r <= d:
            yield (f"rotary dim {r} (head_dim {d} x partial_rotary_factor {cfg.partial_rotary_factor:g}) is not "
                   f"supported: the rotary embedding takes an even number of dims in {lo}..{d}")
        if kv_nvfp4 and d % NVFP4_BLOCK:
            yield (f"head_dim {d} is not supported by an NVFP4 KV cache: it takes multiples of {NVFP4_BLOCK} "
                   "(choose --kv-cache-dtype bf16 or fp8)")
    if cfg.linear_attention_layers and cfg.linear_conv_kernel_dim < CONV_MIN_WIDTH:
        yield (f"linear_conv_kernel_dim {cfg.linear_conv_kernel_dim} is not supported: the causal conv1d takes "
               f"widths from {CONV_MIN_WIDTH} (its state holds width - 1 inputs)")
    if quantized:
        for name, k in _projection_inputs(cfg):
            if k % NVFP4_BLOCK:
                yield (f"{name} {k} is not supported with NVFP4 weights: a projection's input size must be a "
                       f"multiple of {NVFP4_BLOCK} (one E4M3 scale per {NVFP4_BLOCK} values)")
    if not triton:
        return
    if cfg.full_attention_layers:
        if d > ATTENTION_MAX_HEAD_DIM:
            yield f"head_dim {d} is not supported: the attention kernels take 1..{ATTENTION_MAX_HEAD_DIM}"
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        cols = max(16, _pow2(d))
        if max(128, _pow2(group)) * cols > PREFILL_MAX_TILE:
            yield (f"{group} query heads per key/value head (num_attention_heads {cfg.num_attention_heads} / "
                   f"num_key_value_heads {cfg.num_key_value_heads}) at head_dim {d} is not supported: the prefill "
                   f"attention kernel takes groups up to {PREFILL_MAX_TILE // cols} at this head dim (shared memory)")
    if quantized and _fused_decode_norm(cfg) and cfg.hidden_size > NORM_MAX_D:
        yield (f"hidden_size {cfg.hidden_size} is not supported with NVFP4 experts: the decode MoE block's fused "
               f"RMSNorm takes 1..{NORM_MAX_D}")


def _reference_paths(cfg: ModelConfig, quantized: bool, read_through: bool) -> Iterator[str]:
    dk, dv, h, e = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size, cfg.num_experts
    if cfg.linear_attention_layers:
        if dk > GATED_DELTA_MAX_DK:
            yield (f"linear_key_head_dim {dk} > {GATED_DELTA_MAX_DK}: Gated DeltaNet prefill and decode run the "
                   "torch reference (slow; no CUDA graphs)")
        if dv > GATED_DELTA_MAX_DK:
            yield (f"linear_value_head_dim {dv} > {GATED_DELTA_MAX_DK}: Gated DeltaNet prefill runs the torch "
                   "reference (slow; no prefill CUDA graphs)")
        if dv > NORM_MAX_D:
            yield f"linear_value_head_dim {dv} > {NORM_MAX_D}: the gated RMSNorm runs the torch reference (slow)"
    if h > NORM_MAX_D:
        yield f"hidden_size {h} > {NORM_MAX_D}: the RMSNorms run the torch reference (slow)"
    if cfg.moe_layers and e > ROUTER_MAX_EXPERTS:
        yield f"num_experts {e} > {ROUTER_MAX_EXPERTS}: the MoE router runs the torch reference (slow)"
    if read_through and (why := read_through_refusal(cfg, quantized=quantized)):
        yield f"{why}; offloaded decode loads missing experts before each step instead (--no-expert-read-through)"


# ----------------------------------------------------------------------------- helpers
def _projection_inputs(cfg: ModelConfig) -> Iterator[tuple[str, int]]:
    """(name, K) of the projections' input sizes (NVFP4 packs K)."""
    yield "hidden_size", cfg.hidden_size
    if cfg.moe_layers:
        yield "moe_intermediate_size", cfg.moe_intermediate_size
        yield "shared_expert_intermediate_size", cfg.shared_expert_intermediate_size
    if _has_dense_mlp(cfg):
        yield "intermediate_size", cfg.intermediate_size
    if cfg.full_attention_layers:
        yield "num_attention_heads x head_dim", cfg.num_attention_heads * cfg.head_dim
    if cfg.linear_attention_layers:
        yield "linear_num_value_heads x linear_value_head_dim", cfg.linear_value_dim


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    return len(cfg.moe_layers) < cfg.num_hidden_layers


def _fused_decode_norm(cfg: ModelConfig) -> bool:
    """Whether the decode MoE block applies the next layer's norm (`SparseMoE._fused`: NVFP4 experts and a
    shared expert of their width, one pool shape)."""
    return bool(cfg.moe_layers) and cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size


def _pow2(n: int) -> int:
    """The next power of two of n >= 1 (triton.next_power_of_2)."""
    return 1 << max(0, n - 1).bit_length()


def _whole_k(k: int) -> bool:
    """Whether the decode MoE takes K in one or two whole-K tiles (`limits.whole_k_pieces`)."""
    return whole_k_pieces(k) != (0, 0)


def _header_shapes(model_dir: Path, names: list[str]) -> dict[str, list[int]]:
    """Shapes of `names` from the safetensors headers of a checkpoint folder (those it finds)."""
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({model_dir / weight_map[n] for n in names if n in weight_map})
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        shapes: dict[str, list[int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            shapes.update({n: header[n]["shape"] for n in names if n in header})
        return shapes
    except (OSError, ValueError, KeyError, TypeError):  # a malformed folder: the loader says what is wrong
        return {}
