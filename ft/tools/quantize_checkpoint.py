"""`ft quantize`'s checkpoint conversion: read a Hugging Face checkpoint shard by shard, quantize
with `ft.tools.quantize.quantize_state_dict`, write ModelOpt's NVFP4 layout (see that module)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ft.tools.quantize import (  # noqa: F401
    INDEX_NAME,
    NOT_COPIED,
    SINGLE_NAME,
    DEFAULT_EXCLUDE,
    DEFAULT_PRODUCER_VERSION,
    QuantizeError,
    QuantizeStats,
    weight_amax,
    check_finite,
    check_not_quantized,
    plan_quantization,
    quantize_module,
    resolve_device,
    write_json,
    quantize_state_dict,
    write_quant_config,
)
from ft.kernels.nvfp4 import BLOCK_SIZE


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise QuantizeError(f"cannot read {path}: {e}") from e


def _source_shards(src: Path) -> tuple[list[str], dict[str, Any] | None]:
    """(shard file names in order, the index or None for a single model.safetensors)."""
    index_path = src / INDEX_NAME
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise QuantizeError(f"{index_path} has no weight_map")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (src / shard).is_file():
                raise QuantizeError(f"{index_path} names shard {shard!r}, which is not in {src}")
        return shards, index
    if (src / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None
    others = sorted(p.name for p in src.glob("*.safetensors"))
    hint = f" (found {', '.join(others)} but no {INDEX_NAME})" if others else ""
    raise QuantizeError(f"no safetensors checkpoint in {src}: expected {SINGLE_NAME} or {INDEX_NAME}{hint}")


GROUPED = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}
"""A grouped expert tensor's leaf -> the per-expert projections it holds (gate_up: the first and the
second half of each expert's rows)."""


class _Reader:
    """Lazily opened safetensors shards of SRC; reads one tensor at a time. Grouped experts
    (`<m>.experts.gate_up_proj` [E, 2I, H], `<m>.experts.down_proj` [E, H, I]) are listed as their
    per-expert 2-D projections (`<m>.experts.{e}.gate_proj.weight`, ...), cut from the grouped tensor
    when read (the last grouped tensor read is kept, so an expert's siblings cost one read)."""

    def __init__(self, src: Path, shards: list[str]) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.src = src
        self.handles: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self.keys: dict[str, list[str]] = {}
        for shard in shards:
            f = self.handle(shard)
            names = list(f.keys())
            self.keys[shard] = names
            for name in names:
                if name in self.where:
                    raise QuantizeError(f"tensor {name!r} is in both {self.where[name]} and {shard} in {src}")
                sl = f.get_slice(name)
                self.where[name] = shard
                self.shapes[name] = tuple(sl.get_shape())
                self.dtypes[name] = sl.get_dtype()
        self.parts: dict[str, tuple[str, int, int | None]] = {}  # per-expert name -> (grouped name, expert, half)
        self._last: tuple[str, torch.Tensor] | None = None
        for shard in shards:
            self.keys[shard] = [v for name in self.keys[shard] for v in self._expand(name)]

    def _expand(self, name: str) -> list[str]:
        """[name], or the per-expert names a grouped expert tensor stands for (registered)."""
        prefix, _, leaf = name.rpartition(".experts.")
        shape = self.shapes[name]
        if not prefix or leaf not in GROUPED or len(shape) != 3 or (leaf == "gate_up_proj" and shape[1] % 2):
            return [name]
        shard, dtype = self.where.pop(name), self.dtypes.pop(name)
        del self.shapes[name]
        rows = shape[1] // 2 if leaf == "gate_up_proj" else shape[1]
        out = []
        for e in range(shape[0]):
            for part, half in GROUPED[leaf]:
                v = f"{prefix}.experts.{e}.{part}.weight"
                self.where[v], self.shapes[v], self.dtypes[v] = shard, (rows, shape[2]), dtype
                self.parts[v] = (name, e, half)
                out.append(v)
        return out

    def handle(self, shard: str) -> Any:
        if shard not in self.handles:
            try:
                self.handles[shard] = self._open(str(self.src / shard), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise QuantizeError(f"cannot read {self.src / shard}: {e}") from e
        return self.handles[shard]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.parts:
            return self.handle(self.where[name]).get_tensor(name)
        grouped, e, half = self.parts[name]
        if self._last is None or self._last[0] != grouped:
            self._last = (grouped, self.handle(self.where[name]).get_tensor(grouped))
        t = self._last[1][e]
        if half is not None:
            rows = t.shape[0] // 2
            t = t[half * rows: (half + 1) * rows]
        return t.contiguous()

    def metadata(self, shard: str) -> dict[str, str]:
        metadata = dict(self.handle(shard).metadata() or {})
        metadata.setdefault("format", "pt")
        return metadata


def _check_dst(src: Path, dst: Path) -> None:
    if dst.exists():
        if not dst.is_dir():
            raise QuantizeError(f"destination {dst} exists and is not a directory")
        if any(dst.iterdir()):
            raise QuantizeError(f"destination {dst} is not empty: refusing to overwrite it")
        if dst.resolve() == src.resolve():
            raise QuantizeError(f"destination {dst} is the source directory")


def _copy_other_files(src: Path, dst: Path) -> None:
    for entry in sorted(src.iterdir()):
        if entry.name.startswith(".") or any(fnmatch.fnmatch(entry.name, p) for p in NOT_COPIED):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name)
        elif entry.is_file():
            shutil.copy2(entry, dst / entry.name)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quantize_checkpoint(
    src: Path,
    dst: Path,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    progress: bool = True,
    *,
    device: str | torch.device | None = "cpu",
    producer_version: str = DEFAULT_PRODUCER_VERSION,
    scale_2_division: str = "reciprocal",
) -> QuantizeStats:
    """Convert the Hugging Face checkpoint directory SRC to an NVFP4 checkpoint in DST.

    SRC holds config.json and ``model.safetensors`` or ``model.safetensors.index.json`` with its
    shards. Tensors are read one at a time, shard by shard (``safetensors.safe_open``), and DST
    gets the same shard file names, an index whose weight_map names the new tensors (and whose
    ``metadata.total_size`` is the new size), config.json with ``quantization_config``,
    hf_quant_config.json, and a copy of every other file of SRC (tokenizer, generation config,
    chat template, ...). See `quantize_state_dict` for what is quantized.

    DST must not exist or be empty; it is written in a temporary sibling directory that is
    renamed to DST at the end, so a failed run leaves no half-written DST.

    Args:
        device: where to compute (None / "auto": CUDA when present); results are identical.
        scale_2_division: "reciprocal" (default: as ModelOpt computes weight_scale_2 on a GPU,
            where NVIDIA's checkpoints are made) or "exact" (as ModelOpt computes on a CPU).
        producer_version: ``producer.version`` written in the quantization configs (the
            producer name is "modelopt" so that other engines recognise the format).

    Returns:
        QuantizeStats (the caller may ignore it).

    Raises:
        QuantizeError: SRC is missing, has no config.json or no safetensors, is already
            quantized, or DST is not empty.
    """
    src, dst = Path(src), Path(dst)
    if scale_2_division not in ("reciprocal", "exact"):
        raise ValueError(f"scale_2_division must be 'reciprocal' or 'exact', got {scale_2_division!r}")
    if not src.is_dir():
        raise QuantizeError(f"source checkpoint {src} does not exist or is not a directory")
    if not (src / "config.json").is_file():
        raise QuantizeError(f"no config.json in {src}: not a Hugging Face checkpoint directory")
    config = _read_json(src / "config.json")
    if (src / "hf_quant_config.json").is_file() or (isinstance(config, dict) and config.get("quantization_config")):
        raise QuantizeError(f"{src} is already quantized (it has hf_quant_config.json or a quantization_config)")
    shards, index = _source_shards(src)
    _check_dst(src, dst)

    reader = _Reader(src, shards)
    torch_dtypes = {n: _SAFETENSORS_DTYPES.get(d) for n, d in reader.dtypes.items()}
    check_not_quantized(reader.where, torch_dtypes, str(src))
    plan = plan_quantization(reader.shapes, torch_dtypes, tuple(exclude))
    dev = resolve_device(device)
    stats = QuantizeStats(quantized=sorted(plan.quantize), excluded=list(plan.excluded))
    if plan.skipped_k:
        print(
            f"warning: {len(plan.skipped_k)} projection(s) kept dense because K % {BLOCK_SIZE} != 0: "
            + ", ".join(plan.skipped_k[:5]) + (" ..." if len(plan.skipped_k) > 5 else ""),
            file=sys.stderr,
        )

    amaxes: dict[str, torch.Tensor] = {}

    def amax_of(module: str) -> torch.Tensor:
        if module not in amaxes:
            name = f"{module}.weight"
            w = reader.get(name)
            check_finite(name, w)
            amaxes[module] = weight_amax(w.to(dev)).cpu()
        return amaxes[module]

    dst_parent = dst.resolve().parent
    dst_parent.mkdir(parents=True, exist_ok=True)
    tmp = dst_parent / f".{dst.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        from safetensors.torch import save_file
        from tqdm import tqdm

        weight_map: dict[str, str] = {}
        total = sum(len(reader.keys[s]) for s in shards)
        with tqdm(total=total, desc="quantize", unit="tensor", disable=not progress) as bar:
            for shard in shards:
                out: dict[str, torch.Tensor] = {}
                for name in reader.keys[shard]:
                    tensor = reader.get(name)
                    stats.tensors_before += 1
                    stats.bytes_before += _nbytes(tensor)
                    module = name[: -len(".weight")] if name.endswith(".weight") else None
                    if module is not None and module in plan.quantize:
                        group = plan.groups[module]
                        group_amax = torch.stack([amax_of(m) for m in group]).max() if len(group) > 1 else None
                        check_finite(name, tensor)
                        out.update(quantize_module(module, tensor, group_amax, dev, scale_2_division))
                    else:
                        out[name] = tensor
                    bar.update(1)
                for name, t in out.items():
                    weight_map[name] = shard
                    stats.tensors_after += 1
                    stats.bytes_after += _nbytes(t)
                contiguous = {k: v.contiguous() for k, v in out.items()}
                save_file(contiguous, str(tmp / shard), metadata=reader.metadata(shard))
                del out

        if index is not None:
            new_index = dict(index)
            metadata = dict(index.get("metadata") or {})
            metadata["total_size"] = stats.bytes_after
            new_index["metadata"] = metadata
            new_index["weight_map"] = dict(sorted(weight_map.items()))
            write_json(tmp / INDEX_NAME, new_index, indent=2)

        _copy_other_files(src, tmp)
        write_json(tmp / "config.json", config, indent=2)
        write_quant_config(tmp, list(plan.excluded), producer_version)
        reader.handles.clear()
        if dst.exists():
            dst.rmdir()  # checked empty above
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
