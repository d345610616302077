"""How a model splits over tensor-parallel ranks: each rank's heads and its config (no torch:
`ft serve`'s preflight checks a split before anything loads). The tensors are cut in
`ft.model.tp_shard`."""

from __future__ import annotations

import dataclasses

from ft.errors import ConfigError, UnsupportedModelError
from ft.model.config import ModelConfig


def check_split(cfg: ModelConfig, world: int) -> None:
    """Refuse, in one line, a split over `world` ranks that cannot run: Qwen3.8-Flash-Next (not split
    yet), or heads and channels that do not share out (`local_config`'s ConfigError)."""
    if world > 1 and cfg.is_flash_next:
        raise UnsupportedModelError("Qwen3.8-Flash-Next does not run under tensor parallelism yet "
                                    "(--tensor-parallel-size 1)")
    for rank in range(world if world > 1 else 0):
        local_config(cfg, rank, world)


@dataclasses.dataclass(frozen=True)
class Heads:
    """One rank's heads of one attention kind: its query (or value) heads [lo, hi) and the key
    heads [klo, khi) they read; g = query heads per key head in the full model."""

    lo: int
    hi: int
    klo: int
    khi: int
    g: int


def heads_of(n_q: int, n_k: int, rank: int, world: int, what: str) -> Heads:
    """Rank `rank`'s query (value) heads of n_q and the key heads of n_k they read; ConfigError
    when `world` ranks cannot share them."""
    if n_q % world:
        raise ConfigError(f"--tensor-parallel-size {world} does not divide the model's {n_q} {what} heads")
    if n_k % world and world % n_k:
        raise ConfigError(f"--tensor-parallel-size {world} neither divides nor is a multiple of the model's "
                          f"{n_k} key heads ({what})")
    g = n_q // n_k
    lo, hi = rank * n_q // world, (rank + 1) * n_q // world
    return Heads(lo, hi, lo // g, (hi - 1) // g + 1, g)


def local_config(cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The config of rank `rank`'s shard: its heads and intermediate sizes (ConfigError when the
    model does not split `world` ways)."""
    if world == 1:
        return cfg
    a = heads_of(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world, "attention")
    lin = heads_of(cfg.linear_num_value_heads, cfg.linear_num_key_heads, rank, world, "linear-attention value")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
        size = getattr(cfg, name)
        if size % world:
            raise ConfigError(f"--tensor-parallel-size {world} does not divide {name} {size}")
    return dataclasses.replace(
        cfg,
        num_attention_heads=a.hi - a.lo, num_key_value_heads=a.khi - a.klo,
        linear_num_value_heads=lin.hi - lin.lo, linear_num_key_heads=lin.khi - lin.klo,
        moe_intermediate_size=cfg.moe_intermediate_size // world,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world,
        intermediate_size=cfg.intermediate_size // world,
    )
