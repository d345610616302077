"""Model configuration parsed from a checkpoint's config.json.

`ModelConfig` is frozen: everything derived from it (layer indices, projection sizes) is a
property, so nothing is stored twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ft.errors import CheckpointError, UnsupportedModelError
from ft.model.flash_next_config import FLASH_NEXT_ARCHITECTURES, TextConfig, is_flash_next, text_config_dict
from ft.model.rope_config import rope_fields

QWEN3_NEXT = "Qwen3NextForCausalLM"
FLASH_NEXT = FLASH_NEXT_ARCHITECTURES[0]
SUPPORTED_ARCHITECTURES = (QWEN3_NEXT, *FLASH_NEXT_ARCHITECTURES)
# Qwen3.8-Flash-Next's defaults for the fields a config.json may leave out (backbone.md, section 1)
FLASH_NEXT_DEFAULTS = {
    **{k: v for k, v in TextConfig().__dict__.items() if not isinstance(v, tuple) and k != "rope_type"},
    "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640, "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters FreeToken uses (names as in config.json), of Qwen3-Next or of
    Qwen3.8-Flash-Next's language model (`architecture`; the latter's own fields: `flash_next`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_type: str = "default"  # `ft.model.rope_config.ROPE_TYPES`
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # its parameters (factor, ...) as sorted (name, value) pairs
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    architecture: str = QWEN3_NEXT
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ----------------------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        flash_next = is_flash_next(cfg)
        whole = cfg
        if flash_next:  # the language model's fields, under text_config, over the model's defaults;
            # every layer is MoE (decoder_sparse_step and mlp_only_layers are stored but not read)
            cfg = {**FLASH_NEXT_DEFAULTS, **text_config_dict(cfg), "decoder_sparse_step": 1, "mlp_only_layers": []}
        elif not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: "
                f"FreeToken runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        n_layers = int(cfg["num_hidden_layers"])
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            if interval < 1:
                raise CheckpointError(f"config.json: full_attention_interval {interval} must be at least 1")
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n_layers)
            ]
        if len(layer_types) != n_layers:
            raise CheckpointError(
                f"config.json: layer_types has {len(layer_types)} entries, "
                f"num_hidden_layers is {n_layers}"
            )
        bad = sorted(set(layer_types) - {"full_attention", "linear_attention"})
        if bad:
            raise UnsupportedModelError(f"config.json: unsupported layer types {bad}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        try:
            rope_type, rope_scaling = rope_fields(rope)
        except ValueError as e:
            raise UnsupportedModelError(f"config.json: {e}") from None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        try:
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg["num_key_value_heads"]),
                head_dim=int(cfg.get("head_dim") or (hidden // heads if heads > 0 else 0)),
                linear_num_key_heads=int(cfg["linear_num_key_heads"]),
                linear_num_value_heads=int(cfg["linear_num_value_heads"]),
                linear_key_head_dim=int(cfg["linear_key_head_dim"]),
                linear_value_head_dim=int(cfg["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
                num_experts=int(cfg.get("num_experts", 0)),
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
                intermediate_size=int(cfg.get("intermediate_size", 0)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(
                    rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
                ),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                rope_type=rope_type,
                rope_scaling=rope_scaling,
                eos_token_ids=eos_ids,
                torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or whole.get("dtype")
                                or whole.get("torch_dtype") or "bfloat16"),
                architecture=FLASH_NEXT if flash_next else QWEN3_NEXT,
                raw=dict(whole),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: missing required field {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """From a checkpoint's config.json (or that file's path), with `overrides` merged over it
        (`merge_overrides`: what --model-overrides / vLLM's --hf-overrides / SGLang's
        --json-model-override-args give)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json at {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: invalid JSON: {e}") from None
        return cls.from_dict(merge_overrides(cfg, overrides) if overrides else cfg)

    # ----------------------------------------------------------------------------- derived
    @property
    def is_flash_next(self) -> bool:
        return self.architecture == FLASH_NEXT

    @cached_property
    def flash_next(self) -> TextConfig:
        """Qwen3.8-Flash-Next's text config (HyperConnections, QSA, the Engram PLE layer)."""
        if not self.is_flash_next:
            raise AttributeError(f"{self.architecture} has no Qwen3.8-Flash-Next fields")
        try:
            return TextConfig.from_dict(text_config_dict(self.raw))
        except (ValueError, TypeError) as e:
            raise UnsupportedModelError(f"config.json: {e}") from None

    @cached_property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the gated full-attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @cached_property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the Gated DeltaNet layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Model layer indices whose MLP is the sparse MoE block."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    def is_moe_layer(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def context_length(self) -> int:
        """The longest context the checkpoint runs, in tokens: max_position_embeddings, or where the rope
        scales positions by a factor (vLLM's rule, which users know) YaRN's original context
        (original_max_position_embeddings, else max_position_embeddings) or linear's max_position_embeddings
        times it, whichever is larger (Qwen3-Next's card: YaRN factor 4 over 262,144 tokens for 1,048,576)."""
        scaling = dict(self.rope_scaling)
        factor = scaling.get("factor")
        if self.rope_type not in ("yarn", "linear") or not factor:
            return self.max_position_embeddings
        original = scaling.get("original_max_position_embeddings", self.max_position_embeddings) \
            if self.rope_type == "yarn" else self.max_position_embeddings
        return max(self.max_position_embeddings, int(original * factor))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv1d: q, k and v of the linear-attention layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim


def merge_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields with `overrides` over them: a dict value merges into the config's dict of that name
    (`text_config`, `rope_parameters`), any other value replaces it. A `rope_scaling` override also merges into
    `rope_parameters` where the config has that (transformers 5's name for the same dict, which the parser reads
    first), so the spelling of the models' cards (`{"rope_scaling": {"rope_type": "yarn", ...}}`) takes effect
    whichever name the checkpoint was saved with. Returns a new dict; neither argument changes."""

    def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    out = merged(cfg, overrides)
    for scope, over in ((out, overrides), (out.get("text_config"), overrides.get("text_config"))):
        if (isinstance(scope, dict) and isinstance(over, dict) and isinstance(over.get("rope_scaling"), dict)
                and "rope_parameters" not in over and isinstance(scope.get("rope_parameters"), dict)):
            scope["rope_parameters"] = merged(scope["rope_parameters"], over["rope_scaling"])
    return out


def read_quantization(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint folder's quantization settings, without torch: hf_quant_config.json's
    "quantization" (ModelOpt), else config.json's "quantization_config"; {} when it has none."""
    path = Path(model_dir)
    try:
        if (path / "hf_quant_config.json").is_file():
            return json.loads((path / "hf_quant_config.json").read_text()).get("quantization") or {}
        if (path / "config.json").is_file():
            return json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON in its quantization settings: {e}") from None
    return {}
