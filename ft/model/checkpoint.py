"""Reading Hugging Face checkpoints: single or sharded safetensors, bf16/fp16/fp32 or ModelOpt NVFP4.

`CheckpointReader` maps tensor names to shards and reads tensors one at a time. `load_weights`
checks every tensor against the model's specification (`TensorSpec`) and reports, by name, a
missing tensor, an unexpected one, or a wrong shape (expected vs found).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from ft.errors import CheckpointError, UnsupportedModelError
from ft.model.config import read_quantization
from ft.model.layers.linear import NVFP4Weight, weight_nbytes
from ft.model.paged_table import PagedTable
from ft.model.tp_shard import shard_expert_layer
from ft.kernels.moe import SlotWeights

# Tensors a checkpoint may carry that FreeToken does not use.
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", "rotary_emb.inv_freq")
IGNORED_PREFIXES = ("mtp.", "model.visual.")  # the MTP head; Qwen3.8-Flash-Next's vision tower (text only)


@dataclass(frozen=True)
class TensorSpec:
    """One logical weight. kind: 'dense' (plain tensor), 'linear' (dense or NVFP4 projection),
    'expert' (a routed expert projection, or one MoE layer's experts grouped: dense or NVFP4, kept in
    the host store), 'host' (kept in host memory in the checkpoint's dtype, pinned beside a GPU; it may
    be stored as row-contiguous parts `<stem>.shard_{i}.weight`), 'optional' (read and kept where
    the checkpoint has it)."""

    shape: tuple[int, ...]
    kind: str = "dense"


@dataclass(frozen=True)
class GroupedExperts:
    """One MoE layer's routed experts stored grouped: gate_up [E, 2I, H] (each expert's gate rows,
    then its up rows) and down [E, H, I]."""

    gate_up: str
    down: str


@dataclass
class QuantInfo:
    algo: str | None  # None (unquantized) or "NVFP4"
    exclude_modules: tuple[str, ...] = ()
    kv_algo: str | None = None  # None, "FP8" or "NVFP4": the format its per-layer KV scales (k_scale, v_scale) describe


SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                        "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
"""Bytes an element of each safetensors dtype takes."""

HOST_READ_BYTES = 256 << 20
"""The piece a table bound for pinned host memory is read in (`_Consumer.host_rows`)."""


class CheckpointReader:
    """Name -> shard index of a checkpoint directory (model.safetensors or a sharded index)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {self.path}")
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            files = {n: self.path / f for n, f in weight_map.items()}
        elif single.is_file():
            files = None
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"no safetensors weights in {self.path}")
            files = None
        self._handles: dict[Path, object] = {}
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        shard_paths = sorted(set(files.values())) if files else ([single] if single.is_file() else sorted(self.path.glob("*.safetensors")))
        for shard in shard_paths:
            if not shard.is_file():
                raise CheckpointError(f"shard listed in the index is missing: {shard}")
            h = safe_open(str(shard), framework="pt")
            self._handles[shard] = h
            for name in h.keys():
                sl = h.get_slice(name)
                self._file_of[name] = shard
                self._shapes[name] = tuple(sl.get_shape())
                self._dtypes[name] = sl.get_dtype()
        if files:
            missing = sorted(set(files) - set(self._file_of))
            if missing:
                raise CheckpointError(f"tensor {missing[0]!r} is listed in the index but not in its shard")
        self.quant = self._read_quant()

    def _read_quant(self) -> QuantInfo:
        q = read_quantization(self.path)
        if not q:
            return QuantInfo(None)
        kv = q.get("kv_cache_quant_algo")
        if kv is not None and str(kv).upper() not in ("FP8", "NVFP4"):
            raise UnsupportedModelError(f"unsupported KV cache quantization {kv!r}: FreeToken reads FP8 and NVFP4 "
                                        "KV scales")
        kv = None if kv is None else str(kv).upper()
        algo = q.get("quant_algo") or q.get("quant_method")
        if algo is None and kv:
            return QuantInfo(None, kv_algo=kv)
        if str(algo).upper() != "NVFP4":
            raise UnsupportedModelError(f"unsupported quantization {algo!r}: FreeToken reads bf16/fp16/fp32 and NVFP4 (ModelOpt)")
        group = int(q.get("group_size", 16))
        if group != 16:
            raise UnsupportedModelError(f"unsupported NVFP4 group_size {group} (ModelOpt NVFP4 uses 16)")
        return QuantInfo("NVFP4", tuple(q.get("exclude_modules") or q.get("ignore") or ()), kv)

    # ----------------------------------------------------------------------------- access
    def names(self) -> Iterable[str]:
        return self._file_of.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def table_parts(self, name: str) -> list[str]:
        """A host table's tensors in row order: `name` itself, or its parts `<stem>.shard_{i}.weight`."""
        if name in self:
            return [name]
        stem = name.removesuffix(".weight")
        parts = []
        while f"{stem}.shard_{len(parts)}.weight" in self:
            parts.append(f"{stem}.shard_{len(parts)}.weight")
        if not parts:
            raise CheckpointError(f"missing tensor {name!r} (or its parts {stem}.shard_0.weight, ...) in {self.path}")
        return parts

    def file_of(self, name: str) -> Path:
        """The safetensors file holding tensor `name`."""
        return self._file_of[name]

    def nbytes(self, name: str) -> int:
        """Bytes of tensor `name` as stored (from the header: nothing is read)."""
        return math.prod(self.shape(name)) * SAFETENSORS_ITEMSIZE[self.dtype(name)]

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (its first dimension), read without the rest."""
        return self._handles[self._file_of[name]].get_slice(name)[start:stop]

    def read_into(self, name: str, out: torch.Tensor, piece_bytes: int = HOST_READ_BYTES) -> None:
        """Tensor `name` copied into `out` (its shape) a piece of rows of about `piece_bytes` at a time, so
        that reading holds `out` and one piece, not a second copy of the whole."""
        rows = self.shape(name)[0] if self.shape(name) else 0
        if tuple(out.shape) != self.shape(name):
            raise CheckpointError(f"tensor {name!r}: {list(self.shape(name))}, read into {list(out.shape)}")
        step = max(1, piece_bytes // max(1, out[:1].nbytes))
        for row in range(0, rows, step):
            out[row: row + step].copy_(self.get_rows(name, row, min(row + step, rows)))


def _ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES) or name.startswith(IGNORED_PREFIXES)


class _Consumer:
    """Reads tensors for specs, remembers what was used, checks shapes."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.used: set[str] = set()

    def claim(self, name: str, shape: tuple[int, ...] | None) -> None:
        """Check that tensor `name` is there (of `shape`, unless None) and count it as used."""
        if name not in self.reader:
            raise CheckpointError(f"missing tensor {name!r} in {self.reader.path}")
        found = self.reader.shape(name)
        if shape is not None and found != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: expected shape {list(shape)}, found {list(found)}")
        self.used.add(name)

    def take(self, name: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        self.claim(name, shape)
        return self.reader.get(name)

    def host_rows(self, name: str, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
        """A [rows, width] table kept on the host: `name`, or its row-contiguous parts
        `<stem>.shard_{i}.weight` (i = 0, 1, ...) copied in turn into one (pinned) tensor."""
        if name in self.reader and not pin:
            return self.take(name, shape)
        if name in self.reader:  # into the pinned table in pieces: never the whole table twice in host memory
            self.claim(name, shape)
            out = _host_empty(shape, self.reader.get_rows(name, 0, 1).dtype, pin)
            self.reader.read_into(name, out)
            return out
        parts = self.reader.table_parts(name)
        shapes = [self.reader.shape(p) for p in parts]
        if any(len(sh) != 2 or sh[1] != shape[1] for sh in shapes) or sum(sh[0] for sh in shapes) != shape[0]:
            raise CheckpointError(f"tensor {name!r}: {len(parts)} parts of {shapes[0]}... make "
                                  f"[{sum(sh[0] for sh in shapes)}, {shapes[0][1] if shapes[0] else '?'}], expected {list(shape)}")
        first = self.take(parts[0], None)
        out = torch.empty(shape, dtype=first.dtype, pin_memory=pin)
        row = 0
        for p in parts:
            t = first if p == parts[0] else self.take(p, None)
            if t.dtype != first.dtype:
                raise CheckpointError(f"tensor {p!r}: {t.dtype}, its first part is {first.dtype}")
            out[row: row + t.shape[0]].copy_(t)
            row += t.shape[0]
        return out

    def paged_table(self, name: str, shape: tuple[int, ...]) -> PagedTable:
        """A host table mapped from the checkpoint's files instead of read (`ft.model.paged_table`)."""
        parts = self.reader.table_parts(name)
        for p in parts:
            self.claim(p, None)
        return PagedTable.open([(self.reader.file_of(p), p) for p in parts], shape)

    def is_nvfp4(self, module: str) -> bool:
        return f"{module}.weight_scale" in self.reader

    def projection(self, name: str, spec: TensorSpec) -> torch.Tensor | NVFP4Weight:
        """A dense weight [N, K] or the NVFP4 triple of `<module>.weight`."""
        module = name.removesuffix(".weight")
        if not self.is_nvfp4(module):
            if self.reader.quant.algo and name in self.reader and self.reader.dtype(name) == "U8":
                raise CheckpointError(f"tensor {name!r} is packed NVFP4 but {module}.weight_scale is missing")
            return self.take(name, spec.shape)
        n, k = spec.shape
        if k % 16:
            raise CheckpointError(f"tensor {name!r}: NVFP4 needs K % 16 == 0, K = {k}")
        packed = self.take(name, (n, k // 2))
        if packed.dtype != torch.uint8:
            raise CheckpointError(f"tensor {name!r}: NVFP4 weight must be U8, found {packed.dtype}")
        scale = self.take(f"{module}.weight_scale", (n, k // 16))
        if scale.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {module}.weight_scale: must be F8_E4M3, found {scale.dtype}")
        scale_2 = self.take(f"{module}.weight_scale_2", None).float().reshape(())
        return NVFP4Weight(packed, scale, scale_2)


@dataclass
class LoadedWeights:
    """Resident tensors by name (dense or NVFP4) and the routed experts stacked per MoE layer."""

    tensors: dict[str, torch.Tensor | NVFP4Weight]
    experts: SlotWeights | None
    kv_scales: torch.Tensor | None = None  # [full-attention layers, 2] float32 (K, V): ModelOpt's KV scales
    kv_algo: str | None = None  # what kv_scales describe (kv_cache_quant_algo): "FP8" | "NVFP4" | None
    on_host: frozenset[str] = frozenset()  # dense tensors the loader keeps in host memory (the embedding)

    def placed_bytes(self, embedding: str, tables: frozenset[str] = frozenset()) -> tuple[int, dict[str, int]]:
        """(bytes of the weights a model keeps on the device, {what: bytes} of those it keeps in host memory
        beside the routed experts). Host: `tables` (an n-gram table's parts, in host memory on every device) as
        "n-gram table", and the tensor `embedding` as "embedding" when the loader kept it there (`on_host`)."""
        host = set(tables) | self.on_host
        resident = sum(weight_nbytes(t) for n, t in self.tensors.items() if n not in host)
        parts = {}
        in_memory = [n for n in tables if not isinstance(self.tensors[n], PagedTable)]  # (a paged one is on disk)
        if in_memory:
            parts["n-gram table"] = sum(weight_nbytes(self.tensors[n]) for n in in_memory)
        if embedding in self.on_host:
            parts["embedding"] = weight_nbytes(self.tensors[embedding])
        return resident, parts


def host_bytes(reader: CheckpointReader, specs: dict[str, TensorSpec], expert_groups: list, dtype: torch.dtype,
               embedding: str | None = None) -> dict[str, int]:
    """What loading keeps in host memory, from the checkpoint's headers alone: {"routed experts": the
    store `load_weights` fills (NVFP4 as stored with fp32 second scales, dense in `dtype`), "n-gram
    table": the specs' kind "host" tensors (or their parts) as stored, "embedding": tensor `embedding`
    in `dtype` when the loader moves it there (None: it stays on the device)}; parts of 0 left out. (A table
    mapped from the files instead, `PagedTable`, is no host memory: the caller drops its part.)"""
    size = dtype.itemsize
    experts = 0
    for layer in expert_groups:
        if isinstance(layer, GroupedExperts):
            experts += (math.prod(specs[layer.gate_up].shape) + math.prod(specs[layer.down].shape)) * size
            continue
        for names in layer:
            for name in names:
                module = name.removesuffix(".weight")
                if f"{module}.weight_scale" in reader:
                    experts += reader.nbytes(name) + reader.nbytes(f"{module}.weight_scale") + 4
                else:
                    experts += math.prod(specs[name].shape) * size
    tables = 0
    for name, spec in specs.items():
        if spec.kind == "host":
            tables += sum(reader.nbytes(p) for p in reader.table_parts(name))
    parts = {"routed experts": experts, "n-gram table": tables,
             "embedding": math.prod(specs[embedding].shape) * size if embedding else 0}
    return {what: n for what, n in parts.items() if n}


def load_weights(
    reader: CheckpointReader,
    specs: dict[str, TensorSpec],
    expert_groups: list[list[tuple[str, str, str]]],
    dtype: torch.dtype,
    device: torch.device,
    host_device: torch.device,
    progress: bool = False,
    tables_on_disk: bool = False,
    shard: tuple[int, int] = (0, 1),
) -> LoadedWeights:
    """Read and check every tensor.

    specs: name -> TensorSpec for resident weights. expert_groups[j][e] = (gate, up, down) names
    of expert e of MoE layer j (shapes in specs). Dense weights are cast to `dtype`; NVFP4 stays
    packed. Routed experts go to `host_device` (pinned when it is CPU and `device` is CUDA). Kind "host"
    tables are read into host memory (pinned likewise), or with `tables_on_disk` mapped from the files
    (`PagedTable`: nothing read until a step gathers its rows). `shard` (rank, world): the routed experts'
    store holds that tensor-parallel rank's part of every expert (`ft.model.tp_shard.shard_expert_layer`),
    cut as each expert is read, never the whole store.
    """
    from tqdm.auto import tqdm

    c = _Consumer(reader)
    tensors: dict[str, torch.Tensor | NVFP4Weight] = {}
    bar = tqdm(total=len(specs), desc="loading weights", unit="tensor", disable=not progress)
    pin = host_device.type == "cpu" and device.type == "cuda"
    for name, spec in specs.items():
        if spec.kind == "expert":
            continue
        if spec.kind == "host":
            tensors[name] = c.paged_table(name, spec.shape) if tables_on_disk else c.host_rows(name, spec.shape, pin)
            bar.update(1)
            continue
        if spec.kind == "optional" and name not in reader:
            continue
        if spec.kind == "linear":
            w = c.projection(name, spec)
        else:
            w = c.take(name, spec.shape)
        tensors[name] = w if spec.kind == "optional" else _to(w, dtype, device)
        bar.update(1)
    if expert_groups and isinstance(expert_groups[0], GroupedExperts):
        experts = _load_grouped_experts(c, specs, expert_groups, dtype, host_device, device, bar, shard)
    else:
        experts = _load_experts(c, specs, expert_groups, dtype, host_device, device, bar, shard) \
            if expert_groups else None
    bar.close()
    kv_scales = _kv_scales(c, specs)
    unexpected = sorted(n for n in reader.names() if n not in c.used and not _ignored(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {reader.path}{more}")
    return LoadedWeights(tensors, experts, kv_scales, reader.quant.kv_algo)


def _kv_scales(c: _Consumer, specs: dict[str, TensorSpec]) -> torch.Tensor | None:
    """ModelOpt's KV-cache scales, FP8 or NVFP4 (`model.layers.N.self_attn.k_proj.k_scale`,
    `v_proj.v_scale`, scalars: the cache holds x / scale; for NVFP4 the second-level scale) of every
    full-attention layer, in layer order -> [L, 2] float32; None when the checkpoint has none. Some
    layers with and some without is an error."""
    attn = [n.removesuffix("k_proj.weight") for n in specs if n.endswith("self_attn.k_proj.weight")]
    found = [(p + "k_proj.k_scale") in c.reader for p in attn]
    if not any(found):
        return None
    if not all(found):
        missing = attn[found.index(False)] + "k_proj.k_scale"
        raise CheckpointError(f"missing tensor {missing!r} in {c.reader.path} (the other layers have KV scales)")
    rows = []
    for p in attn:
        k, v = (c.take(p + name, None).float().reshape(-1) for name in ("k_proj.k_scale", "v_proj.v_scale"))
        if k.numel() != 1 or v.numel() != 1 or not (k > 0).all() or not (v > 0).all():
            raise CheckpointError(f"{p}k_proj.k_scale / v_proj.v_scale must be positive scalars")
        rows.append(torch.cat([k, v]))
    return torch.stack(rows)


def _to(w: torch.Tensor | NVFP4Weight, dtype: torch.dtype, device: torch.device):
    if isinstance(w, NVFP4Weight):
        return NVFP4Weight(w.packed.to(device), w.scale.to(device), w.scale_2.to(device))
    return w.to(device=device, dtype=dtype)


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _load_grouped_experts(c, specs, groups: list[GroupedExperts], dtype, host_device, device, bar,
                          shard: tuple[int, int] = (0, 1)) -> SlotWeights:
    """Grouped dense experts -> SlotWeights [L, E, ...] on the host (w13 = gate_up as stored: gate
    rows then up rows, as `_load_experts` concatenates them), each layer copied into the store as it
    is read (the store and one layer's tensors at a time: `_load_experts` says why)."""
    if any(c.is_nvfp4(g.gate_up) or c.reader.quant.algo for g in groups):
        raise UnsupportedModelError("NVFP4 grouped experts (the published Qwen3.8-Flash-Next layout) are not "
                                    "read yet: load a bf16/fp32 checkpoint")
    pin = host_device.type == "cpu" and device.type == "cuda"
    w13 = w2 = None
    for layer, g in enumerate(groups):
        p13, _, p2, _ = shard_expert_layer(c.take(g.gate_up, specs[g.gate_up].shape), None,
                                           c.take(g.down, specs[g.down].shape), None, *shard)
        if w13 is None:
            w13 = _host_empty((len(groups), *p13.shape), dtype, pin)
            w2 = _host_empty((len(groups), *p2.shape), dtype, pin)
        w13[layer].copy_(p13)
        w2[layer].copy_(p2)
        bar.update(2)
    return SlotWeights(w13=w13, w2=w2)


def _load_experts(c, specs, groups, dtype, host_device, device, bar, shard: tuple[int, int] = (0, 1)) -> SlotWeights:
    """Experts stored one tensor each -> SlotWeights with leading dims [L, E] on the host.

    The store is allocated (pinned beside a GPU) once the first expert is read, and every expert is
    copied into its place as it is read: loading holds the store and one expert. (Stacking the read
    experts afterwards held them two to three times over at its peak, the read tensors, a pageable stack
    and its pinned copy: ~150 GiB of host memory for Qwen3.8-Flash-Next's 63 GiB of NVFP4 experts.)"""
    pin = host_device.type == "cpu" and device.type == "cuda"
    n_layers, n_exp = len(groups), len(groups[0])
    store: SlotWeights | None = None
    nvfp4 = False
    for layer, names_of_layer in enumerate(groups):
        for e, names in enumerate(names_of_layer):
            gate, up, down = (c.projection(n, specs[n]) for n in names)
            if any(isinstance(p, NVFP4Weight) != isinstance(gate, NVFP4Weight) for p in (up, down)) or (
                    store is not None and isinstance(gate, NVFP4Weight) != nvfp4):
                raise CheckpointError(f"expert {names[0]!r}: experts mix NVFP4 and dense weights")
            if isinstance(gate, NVFP4Weight):
                w13, s13, w2, s2 = shard_expert_layer(torch.cat([gate.packed, up.packed]), torch.cat([gate.scale, up.scale]),
                                                      down.packed, down.scale, *shard)
                scale_2 = torch.stack([gate.scale_2, up.scale_2, down.scale_2])
            else:
                (w13, s13, w2, s2), scale_2 = shard_expert_layer(torch.cat([gate, up]), None, down, None, *shard), None
            if store is None:
                nvfp4 = isinstance(gate, NVFP4Weight)
                store = _expert_store(n_layers, n_exp, w13, s13, w2, s2, dtype, pin)
            store.w13[layer, e].copy_(w13)
            store.w2[layer, e].copy_(w2)
            if nvfp4:
                store.w13_scale[layer, e].copy_(s13)
                store.w2_scale[layer, e].copy_(s2)
                store.scale_2[layer, e].copy_(scale_2)
            del gate, up, down, w13, s13, w2, s2  # (before the next expert is read: one expert at a time)
            bar.update(3)
    return store


def _expert_store(n_layers: int, n_exp: int, w13, s13, w2, s2, dtype: torch.dtype, pin: bool) -> SlotWeights:
    """An empty [L, E, ...] expert store shaped after one expert's stacked gate/up and down (`SlotWeights`'
    per-slot tensors): NVFP4 (packed bytes, E4M3 block scales, the three fp32 second scales; s13 / s2 given)
    or dense in `dtype` (s13 / s2 None)."""
    lead = (n_layers, n_exp)
    if s13 is None:
        return SlotWeights(w13=_host_empty((*lead, *w13.shape), dtype, pin), w2=_host_empty((*lead, *w2.shape), dtype, pin))
    return SlotWeights(
        w13=_host_empty((*lead, *w13.shape), w13.dtype, pin), w2=_host_empty((*lead, *w2.shape), w2.dtype, pin),
        w13_scale=_host_empty((*lead, *s13.shape), s13.dtype, pin), w2_scale=_host_empty((*lead, *s2.shape), s2.dtype, pin),
        scale_2=_host_empty((*lead, 3), torch.float32, pin),
    )
