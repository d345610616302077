"""Qwen3.8-Flash-Next's text configuration, read from a checkpoint's config.json (torch-free).

The checkpoint's config.json is the multimodal model's (`Qwen3_8_FlashNextForConditionalGeneration`,
model_type "qwen3_8_flash_next"; the released files use the legacy names "qwen4_exp" /
`Qwen4ExpForConditionalGeneration`); the language model's fields sit under `text_config`.
docs/qwen3.8-flash-next/backbone.md (section 1) lists the fields and their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ft.model.rope_config import rope_fields

__all__ = ["FLASH_NEXT_ARCHITECTURES", "TextConfig", "is_flash_next", "text_config_dict"]

FLASH_NEXT_ARCHITECTURES = ("Qwen3_8_FlashNextForConditionalGeneration", "Qwen4ExpForConditionalGeneration")
FLASH_NEXT_MODEL_TYPES = ("qwen3_8_flash_next", "qwen4_exp", "qwen3_8_flash_next_text", "qwen4_exp_text")


def is_flash_next(cfg: dict[str, Any]) -> bool:
    """Whether a config.json is Qwen3.8-Flash-Next's (by its architectures, else its model_type)."""
    archs = cfg.get("architectures") or []
    return any(a in FLASH_NEXT_ARCHITECTURES for a in archs) or cfg.get("model_type") in FLASH_NEXT_MODEL_TYPES


def text_config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: `text_config` (a text-only config.json is its own), with the top
    level's token ids where the text config leaves them out."""
    text = dict(cfg.get("text_config") or cfg)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


@dataclass(frozen=True)
class TextConfig:
    """The text config fields the model reads (names as in the checkpoint's `text_config`)."""

    vocab_size: int = 248320
    hidden_size: int = 2560
    num_hidden_layers: int = 48
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    hc_count: int = 4
    hc_lowrank: int = 320
    indexer_n_heads: int = 4
    indexer_kv_heads: int = 1
    indexer_head_dim: int = 128
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    ple_layer_ids: tuple[int, ...] = ()
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ple_embed_dim: int = 0
    """Width of a token's concatenated table rows (0: hidden_size)."""
    ple_conv_kernel_size: int = 4
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    eos_token_id: int = 248044
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()
    """The rope type's fields of `rope_parameters` (`ft.model.rope_config.ROPE_SCALING_KEYS`: factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim,
    truncate) as sorted (name, value) pairs."""

    @classmethod
    def from_dict(cls, d: dict) -> TextConfig:
        """From a text config's fields (unknown ones ignored; `hc_mult` is `hc_count`'s alias; an
        `eos_token_id` list keeps its first id, the one the n-gram hash resets on)."""
        d = dict(d)
        if d.get("hc_count") is None and d.get("hc_mult") is not None:
            d["hc_count"] = d["hc_mult"]
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = d["eos_token_id"][0] if d["eos_token_id"] else None
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in fields and "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" not in fields and "partial_rotary_factor" in rope:
            fields["partial_rotary_factor"] = rope["partial_rotary_factor"]
        fields["rope_type"], fields["rope_scaling"] = rope_fields(rope)  # (ValueError: a type the model cannot run)
        for k in ("layer_types", "ple_layer_ids"):
            if k in fields:
                fields[k] = tuple(fields[k])
        return cls(**fields)

    def is_attention(self, i: int) -> bool:
        if self.layer_types:
            return self.layer_types[i] == "full_attention"
        return (i + 1) % self.full_attention_interval == 0

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """0-based decoder layers with a PLE layer before them (`ple_layer_ids` are 1-based)."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def dense_context_limit(self) -> int:
        """The longest context QSA attends to whole: a query at position t sees every token while its
        complete blocks (t + 1) // ratio fit the budget's blocks, so up to t = budget + ratio - 2
        (the budget in whole blocks)."""
        ratio = self.indexer_compress_ratio
        return self.indexer_budget // ratio * ratio + ratio - 1

    def unsupported(self, rotary_dim: int) -> list[str]:
        """What of this config the model cannot run (one line each; empty: all of it). rotary_dim: the
        attention's (the indexer rotates the same number of its features)."""
        out = []
        if self.hc_count < 1 or self.hc_lowrank < 1:
            out.append(f"hc_count {self.hc_count} and hc_lowrank {self.hc_lowrank} must be at least 1")
        if self.indexer_kv_heads != 1:
            out.append(f"indexer_kv_heads {self.indexer_kv_heads}: QSA's indexer has one key head")
        if self.indexer_compress_ratio < 1 or self.indexer_budget < self.indexer_compress_ratio:
            out.append(f"indexer_budget {self.indexer_budget} and indexer_compress_ratio {self.indexer_compress_ratio}: "
                       "the budget must hold at least one block")
        if self.indexer_n_heads < 1 or not rotary_dim <= self.indexer_head_dim:
            out.append(f"indexer_head_dim {self.indexer_head_dim} with {self.indexer_n_heads} heads: the indexer "
                       f"rotates its first {rotary_dim} features (the attention's rotary dim)")
        if self.ple_layer_ids:
            if len(self.ple_layer_ids) != 1 or not 1 <= self.ple_layer_ids[0] <= self.num_hidden_layers:
                out.append(f"ple_layer_ids {list(self.ple_layer_ids)}: one PLE layer, 1-based, is supported")
            if self.ngram_size < 2 or self.heads_per_ngram < 1 or self.ple_conv_kernel_size < 1:
                out.append(f"ngram_size {self.ngram_size}, heads_per_ngram {self.heads_per_ngram}, ple_conv_kernel_size "
                           f"{self.ple_conv_kernel_size}: n-grams of at least 2 tokens, one head and one tap")
        return out
