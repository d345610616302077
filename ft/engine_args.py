"""argparse flags of the engine, read from `EngineConfig`'s fields so each default lives there.

No torch import: `ft --help` and `ft ctl` stay instant.
"""

from __future__ import annotations

import argparse
import dataclasses

from ft.engine.engine_config import KV_CACHE_DTYPES, EngineConfig

HELP = {
    "model": "checkpoint directory (Hugging Face layout); 'demo' or nothing: the built-in demo model",
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "compute dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16",
    "moe_backend": "offload: experts in host memory, an LRU cache of device slots; resident: every expert on the device",
    "moe_cache_size": "expert slots on the device (offload backend)",
    "moe_cache_auto": "expert slots fill what the budget leaves after KV and mamba (the default without --moe-cache-size)",
    "expert_policy": ("offload: which resident experts make room for misses: lru (least recently used) or lfu "
                      "(least frequently used, with aging)"),
    "expert_read_through": ("offload: decode reads a missing expert from host memory inside the step (CUDA graph, no "
                            "sync) and caches it in a reserved slot; --no-expert-read-through loads misses before each "
                            "MoE layer instead (host bookkeeping, no graphs)"),
    "num_tokens": "KV cache capacity in tokens (default: the whole context when it fits)",
    "kv_cache_dtype": ("KV cache dtype: auto (fp8 when the checkpoint carries FP8 KV scales, else the compute dtype), "
                       "bf16, or fp8 (e4m3 with a per-layer K and V scale: half of bf16's bytes per token)"),
    "max_seq_len_override": "context limit in tokens instead of the checkpoint's max_position_embeddings",
    "memory_ratio": "fraction of the free device memory the cache pools may use",
    "gpu_memory_limit": "act as if the card had this much memory (e.g. 16GiB); on CPU the emulated card (default 96MiB)",
    "cache_budget": "cap the cache pools' budget at this size (e.g. 4.8GiB), below what the card leaves",
    "page_size": "tokens per KV page",
    "max_running_requests": "requests decoded together at most",
    "max_prefill_length": "tokens per prefill chunk",
    "mamba_cache_size": "linear-attention state slots (default: 2 x max running requests, at least 4)",
    "enable_prefix_cache": "reuse KV and linear-attention state of earlier requests (--no-enable-prefix-cache to turn off)",
    "enable_kv_ladder": "grow KV rung by rung when a request needs the context, trading expert slots; shrink back later",
    "ladder_step_size": "tokens between ladder rungs (KV starts at twice this)",
    "ladder_min_reuse": "a request that reuses less than this fraction of its prompt from the prefix cache may shrink the ladder",
    "ladder_dwell_s": "least seconds on a rung before the ladder shrinks",
    "ladder_grow_hold_s": "no shrink for this many seconds after a grow",
    "cuda_graph_max_bs": "decode batches up to this many requests replay one CUDA graph per batch-size bucket",
    "disable_cuda_graph": "run every decode step eagerly, without CUDA graphs (debugging)",
    "storage_backend": ("how the pools resize: vmm (CUDA virtual memory) or mmap (host, Linux) free before they "
                        "allocate; realloc copies, so a resize holds old and new and the reachable ranges are narrower; "
                        "auto picks the best available"),
    "seed": "engine seed",
    "progress": "show loading progress",
}


CHOICES = {"moe_backend": ["offload", "resident"], "expert_policy": ["lru", "lfu"], "kv_cache_dtype": list(KV_CACHE_DTYPES), "storage_backend": ["auto", "vmm", "mmap", "realloc"], "dtype": ["auto", "float32", "bfloat16", "float16"]}


def _kind(f: dataclasses.Field):
    """The argparse type of a field from its annotation ("int | None" -> int; byte sizes -> str)."""
    kinds = [k.strip() for k in str(f.type).split("|")]
    if "str" in kinds:  # byte sizes ("16GiB", "4.8GiB", "512MiB" or plain bytes): EngineConfig parses them
        return str
    return {"bool": bool, "int": int, "float": float}.get(kinds[0], str)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _kind(f)
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=HELP.get(f.name))
        else:
            g.add_argument(flag, type=kind, default=f.default, choices=CHOICES.get(f.name), help=HELP.get(f.name))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
