"""Synthetic checkpoints: random NVFP4 weights generated on the device from a config.json alone.

`LLM(model="synthetic:PATH/config.json")` builds a model with the flagship's (or any) geometry
for benchmarks, with nothing downloaded: projections are NVFP4 in ModelOpt's layout (except the
modules ModelOpt leaves dense: routers, gates, lm_head, conv1d, in_proj_ba), with random codes
and scales sized so activations stay finite; routed experts go to the host store (pinned on
CUDA) exactly as a loaded checkpoint's would. The demo's byte-level tokenizer stands in.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from ft.errors import ConfigError
from ft.model.checkpoint import GroupedExperts, LoadedWeights, TensorSpec
from ft.model.layers.linear import NVFP4Weight
from ft.model.paged_table import DTYPES as PAGED_DTYPES, PagedTable
from ft.kernels.moe import SlotWeights
from ft.units import format_bytes

PREFIX = "synthetic:"
DENSE_MODULES = ("lm_head", "*.mlp.gate", "*.shared_expert_gate", "*.conv1d", "*.in_proj_ba", "*.in_proj_b",
                 "*.in_proj_a")
WEIGHT_STD = 0.02
_E2M1_RMS_TIMES_SCALE = 3.5  # rms of random e2m1 codes (2.93) x mean block scale (~1.2)


def is_synthetic(model: str | None) -> bool:
    return bool(model) and str(model).startswith(PREFIX)


def config_path(model: str) -> Path:
    return Path(model[len(PREFIX):]).expanduser()


class _Gen:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.g = torch.Generator(device=device).manual_seed(seed)

    def normal(self, shape, std, dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g, device=self.device) * std).to(dtype)

    def uniform(self, shape, lo, hi) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device) * (hi - lo) + lo

    def nvfp4(self, n: int, k: int, lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (*lead, n, k // 2), generator=self.g, device=self.device, dtype=torch.uint8)
        scale = self.uniform((*lead, n, k // 16), 0.5, 2.0).to(torch.float8_e4m3fn)
        scale_2 = torch.full(lead, WEIGHT_STD / _E2M1_RMS_TIMES_SCALE, device=self.device)
        return packed, scale, scale_2


def synthetic_weights(
    specs: dict[str, TensorSpec],
    expert_groups: list[list[tuple[str, str, str]]],
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    shard: tuple[int, int] = (0, 1),
    tables_on_disk: bool = False,
) -> LoadedWeights:
    """Random weights for `specs`; the routed experts of tensor-parallel rank shard[0] of shard[1]
    (`ft.model.tp_shard.shard_expert_layer`: cut a layer at a time, so the host never holds
    the whole store); the resident tensors whole (the caller cuts them). With `tables_on_disk` a kind "host"
    table is written to a file and mapped from it (`_disk_table`), as a checkpoint's is with --ngram-table disk."""
    gen = _Gen(device, seed)
    tensors: dict[str, torch.Tensor | NVFP4Weight] = {}
    for name, spec in specs.items():
        if spec.kind in ("expert", "optional"):
            continue
        if spec.kind == "host":  # (Qwen3.8-Flash-Next's n-gram table) made on the host, in row blocks
            tensors[name] = _disk_table(spec.shape, dtype, seed) if tables_on_disk else \
                _host_table(spec.shape, dtype, seed, pin=device.type == "cuda")
            continue
        module = name.removesuffix(".weight")
        if spec.kind == "linear" and not any(fnmatch.fnmatch(module, p) for p in DENSE_MODULES):
            packed, scale, scale_2 = gen.nvfp4(*spec.shape)
            tensors[name] = NVFP4Weight(packed, scale, scale_2.reshape(()))
        elif name.endswith("A_log"):
            tensors[name] = gen.uniform(spec.shape, 1.0, 16.0).log().to(dtype)
        elif name.endswith("dt_bias"):
            tensors[name] = torch.ones(spec.shape, dtype=dtype, device=device)
        elif name.endswith("norm.weight") and "linear_attn" in name:
            tensors[name] = torch.ones(spec.shape, dtype=dtype, device=device)
        elif "norm" in name:
            tensors[name] = gen.normal(spec.shape, 0.05, dtype)
        else:
            std = 0.2 if name.endswith("conv1d.weight") else (0.1 if name.endswith("mlp.gate.weight") else WEIGHT_STD)
            tensors[name] = gen.normal(spec.shape, std, dtype)
    experts = _experts(gen, specs, expert_groups, shard) if expert_groups else None
    return LoadedWeights(tensors, experts)


SAFETENSORS_DTYPES = {dtype: name for name, dtype in PAGED_DTYPES.items()}
"""The safetensors name of each dtype a synthetic table on disk may have (`ft.model.paged_table`'s, inverted)."""
DISK_SPARE = 1 << 30
"""Bytes a synthetic table on disk leaves free in the temporary directory."""


def disk_table_fits(specs: dict[str, TensorSpec], dtype: torch.dtype) -> bool:
    """Whether the temporary directory has room for the synthetic tables written for --ngram-table disk."""
    need = sum(math.prod(spec.shape) for spec in specs.values() if spec.kind == "host") * dtype.itemsize
    return shutil.disk_usage(tempfile.gettempdir()).free >= need + DISK_SPARE


def synthetic_host_bytes(specs: dict[str, TensorSpec], expert_groups: list, dtype: torch.dtype,
                         embedding: str | None = None) -> dict[str, int]:
    """What `synthetic_weights` (one GPU) and the loader keep in host memory, before anything is made:
    `ft.model.checkpoint.host_bytes`' parts for the NVFP4 experts and `dtype` tables made here."""
    experts = 0
    for layer in expert_groups:
        if isinstance(layer, GroupedExperts):
            n_exp, two_full, hidden = specs[layer.gate_up].shape
            full = two_full // 2
        else:
            n_exp, (full, hidden) = len(layer), specs[layer[0][0]].shape
        # w13 and w2 packed (half a byte an element), their E4M3 scales (one a 16), three fp32 second scales
        experts += n_exp * (3 * full * hidden // 2 + 3 * full * hidden // 16 + 12)
    tables = sum(math.prod(spec.shape) for spec in specs.values() if spec.kind == "host") * dtype.itemsize
    parts = {"routed experts": experts, "n-gram table": tables,
             "embedding": math.prod(specs[embedding].shape) * dtype.itemsize if embedding else 0}
    return {what: n for what, n in parts.items() if n}


def _table_blocks(shape: tuple[int, int], dtype: torch.dtype, seed: int):
    """A [rows, width] table of N(0, WEIGHT_STD) values, drawn a block of rows at a time: (first row, block)."""
    g = torch.Generator().manual_seed(seed + 1)
    block = max(1, (64 << 20) // max(1, shape[1]))
    for a in range(0, shape[0], block):
        yield a, (torch.randn((min(block, shape[0] - a), shape[1]), generator=g) * WEIGHT_STD).to(dtype)


def _host_table(shape: tuple[int, int], dtype: torch.dtype, seed: int, pin: bool) -> torch.Tensor:
    """The table (`_table_blocks`) in host memory."""
    out = torch.empty(shape, dtype=dtype, pin_memory=pin)
    for a, rows in _table_blocks(shape, dtype, seed):
        out[a: a + rows.shape[0]].copy_(rows)
    return out


def _disk_table(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> PagedTable:
    """The same table (`_table_blocks`, the same values) written a block at a time to a safetensors file in the
    temporary directory and mapped from it (`PagedTable`); the file is unlinked once mapped, so the mapping
    alone keeps it (nothing is left behind when the process ends)."""
    name = "table.weight"
    need, where = math.prod(shape) * dtype.itemsize, tempfile.gettempdir()
    if shutil.disk_usage(where).free < need + DISK_SPARE:
        raise ConfigError(f"--ngram-table disk: a synthetic n-gram table of {format_bytes(need)} does not fit the "
                          f"{format_bytes(shutil.disk_usage(where).free)} free in {where} (TMPDIR)")
    header = json.dumps({name: {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                                "data_offsets": [0, math.prod(shape) * dtype.itemsize]}}).encode()
    header += b" " * (-len(header) % 8)  # (the data starts 8-byte aligned)
    fd, path = tempfile.mkstemp(prefix="ft-synthetic-table-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for _, rows in _table_blocks(shape, dtype, seed):
                f.write(rows.view(torch.uint8).numpy().tobytes())
        return PagedTable.open([(Path(path), name)], shape)
    finally:
        os.unlink(path)


def _experts(gen: _Gen, specs, groups, shard: tuple[int, int] = (0, 1)) -> SlotWeights:
    """Stacked [L, E, ...] NVFP4 experts, generated a layer at a time on the device and copied to
    the host store (pinned when the device is CUDA); with a tensor-parallel shard, its part."""
    from ft.model.tp_shard import shard_expert_layer

    if isinstance(groups[0], GroupedExperts):  # one [E, 2I, H] tensor per layer
        n_layers, (n_exp, two_full, hidden) = len(groups), specs[groups[0].gate_up].shape
        full = two_full // 2
    else:
        n_layers, n_exp = len(groups), len(groups[0])
        full, hidden = specs[groups[0][0][0]].shape
    rank, world = shard
    inter = full // world
    pin = gen.device.type == "cuda"

    def host(shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    w13 = host((n_layers, n_exp, 2 * inter, hidden // 2), torch.uint8)
    s13 = host((n_layers, n_exp, 2 * inter, hidden // 16), torch.float8_e4m3fn)
    w2 = host((n_layers, n_exp, hidden, inter // 2), torch.uint8)
    s2 = host((n_layers, n_exp, hidden, inter // 16), torch.float8_e4m3fn)
    g = host((n_layers, n_exp, 3), torch.float32)
    for layer in range(n_layers):
        p13, sc13, g13 = gen.nvfp4(2 * full, hidden, (n_exp,))
        p2, sc2, g2 = gen.nvfp4(hidden, full, (n_exp,))
        if world > 1:
            p13, sc13, p2, sc2 = shard_expert_layer(p13, sc13, p2, sc2, rank, world)
        w13[layer].copy_(p13)
        s13[layer].copy_(sc13)
        w2[layer].copy_(p2)
        s2[layer].copy_(sc2)
        g[layer].copy_(torch.stack([g13, g13, g2], dim=-1))
    return SlotWeights(w13, w2, s13, s2, g)
