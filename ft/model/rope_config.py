"""The RoPE fields of a config.json (torch-free): which rope type and which of its parameters.

Configs name them in `rope_parameters` (transformers 5) or the older `rope_scaling` (with `type` for
`rope_type`); both Qwen3-Next's and Qwen3.8-Flash-Next's configs are read here, and
`ft.model.layers.rotary.rope_inv_freq` computes the frequencies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROPE_SCALING_KEYS", "ROPE_TYPES", "rope_fields"]

ROPE_TYPES = ("default", "linear", "yarn")
"""The rope types the models run: plain, linear position interpolation, YaRN."""
ROPE_SCALING_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                     "mscale", "mscale_all_dim", "truncate")
"""The fields those types read beside rope_theta and partial_rotary_factor."""


def rope_fields(rope: dict[str, Any]) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """(rope_type, its parameters as sorted (name, value) pairs, those of `ROPE_SCALING_KEYS` that are set)
    of a config's `rope_parameters` / `rope_scaling` dict (empty: "default").

    Raises ValueError for a rope type outside `ROPE_TYPES`, a "linear" one without a positive factor, a
    "yarn" one with a factor that is not positive (none: max_position_embeddings over the original context),
    or an original_max_position_embeddings that is not positive."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} (FreeToken runs {', '.join(map(repr, ROPE_TYPES))})")
    scaling = tuple(sorted((k, rope[k]) for k in ROPE_SCALING_KEYS if rope.get(k) is not None))
    factor = dict(scaling).get("factor")
    if rope_type == "linear" and not (isinstance(factor, (int, float)) and factor > 0):
        raise ValueError(f"rope_type 'linear' needs a positive factor, got {factor!r}")
    if rope_type == "yarn" and factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
        raise ValueError(f"rope_type 'yarn': factor must be positive, got {factor!r}")
    original = dict(scaling).get("original_max_position_embeddings")
    if original is not None and not (isinstance(original, (int, float)) and original > 0):
        raise ValueError(f"rope_type {rope_type!r}: original_max_position_embeddings must be positive, "
                         f"got {original!r}")
    return rope_type, scaling
