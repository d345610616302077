"""NVFP4 quantization of a state dict in ModelOpt's checkpoint format (`ft quantize`'s core;
`quantize_checkpoint.py` converts whole checkpoints, `quantize_cli.py` is the command).

The output is laid out as NVIDIA ModelOpt's unified HF export (``export_hf_checkpoint``) writes
an NVFP4 model, so FreeToken, vLLM, SGLang and TensorRT-LLM read it alike. For every quantized
projection ``<module>`` (a 2-D ``<module>.weight`` [N, K], K % 16 == 0, not excluded):

* ``<module>.weight``         uint8 [N, K/2]      E2M1 codes, element 2j in the low nibble
* ``<module>.weight_scale``   float8_e4m3fn [N, K/16] per-16-element block scales
* ``<module>.weight_scale_2`` float32 []          per-tensor scale
* ``<module>.input_scale``    float32 []          activation scale, always 1.0 (see below)

Weights are quantized by `ft.tools.nvfp4_quantize.quantize_nvfp4` (ModelOpt's algorithm bit for bit;
by default with ``weight_scale_2`` rounded as ModelOpt rounds it on a GPU, the same on any device).
Like ModelOpt's export (``requantize_resmooth_fused_llm_layers`` -> ``preprocess_linear_fusion``),
quantized sibling projections that read the same input share one ``weight_scale_2``, computed
from the largest amax of the group: ``q_proj/k_proj/v_proj``, ``gate_proj/up_proj`` (of each
expert, of the shared expert, of a dense MLP) and ``in_proj_qkvz/in_proj_ba``. Engines that fuse
those projections into one GEMM need the shared scale.

``input_scale``: ModelOpt's ``quant_algo: "NVFP4"`` is W4A4 and its checkpoints carry a
calibrated ``input_scale`` (activation amax / (6 * 448)) for every quantized linear. This
converter does no activation calibration (FreeToken computes with bf16 activations and ignores
``input_scale``), so it writes 1.0 for every quantized module, which keeps the files in the shape
the NVFP4 loaders of other engines expect.

Experts stored grouped (``<m>.experts.gate_up_proj`` [E, 2I, H], ``<m>.experts.down_proj`` [E, H, I]:
Qwen3.8-Flash-Next's, the Qwen3.5-MoE layout) are written one module per expert and projection
(``<m>.experts.{e}.{gate,up,down}_proj``), as ModelOpt writes MoE experts, and quantized like them
(`quantize_checkpoint`). Everything else (embeddings, norms, excluded modules, 1-D/3-D tensors) is
copied unchanged, in its own dtype. ``hf_quant_config.json`` and ``config.json``'s ``quantization_config`` are written
as ModelOpt writes them; ``exclude_modules`` lists every module whose >=2-D weight stays dense
(embeddings included, as ModelOpt 0.47 lists ``model.embed_tokens``), so that loaders do not
look for NVFP4 tensors there.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ft import __version__
from ft.errors import FreeTokenError
from ft.kernels.nvfp4 import BLOCK_SIZE
from ft.tools.nvfp4_quantize import quantize_nvfp4

__all__ = [
    "DEFAULT_EXCLUDE",
    "QuantizeError",
    "QuantizeStats",
    "quantize_state_dict",
    "quantization_config_for",
    "write_quant_config",
]

DEFAULT_EXCLUDE: tuple[str, ...] = (
    "lm_head",
    "*.mlp.gate",
    "*.shared_expert_gate",
    "*.conv1d",
    "*.in_proj_ba",
    "*.in_proj_b",
    "*.in_proj_a",
)
"""fnmatch patterns over module names (tensor name less ``.weight``) kept in high precision."""

NEVER_QUANTIZE: tuple[str, ...] = ("*embed_tokens", "*embeddings", "*.wte", "*.wpe", "*hyper_connection*", "*.ple.*")
"""Embedding tables (looked up by index, not multiplied) and what FreeToken reads only dense
(Qwen3.8-Flash-Next's HyperConnections and its PLE layer, the n-gram table among it): never
quantized, whatever `exclude` says; listed in ``exclude_modules`` like ModelOpt lists
``model.embed_tokens``."""

FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkvz", "in_proj_ba"),
    ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b", "in_proj_a"),
)
"""Leaf names of projections that read the same input and so share ``weight_scale_2``."""

QUANT_ALGO = "NVFP4"
INPUT_SCALE = 1.0
DEFAULT_PRODUCER_VERSION = f"freetoken-{__version__}"

_QUANT_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files in SRC that are not copied: the weights (rewritten), the configs (rewritten) and
# other formats of the same weights.
NOT_COPIED = ("*.safetensors", INDEX_NAME, "config.json", "hf_quant_config.json",
               "pytorch_model*.bin", "pytorch_model.bin.index.json")


class QuantizeError(FreeTokenError, ValueError):
    """The checkpoint cannot be converted as asked; the message names the path or tensor."""


@dataclass
class QuantizeStats:
    """What a conversion did."""

    quantized: list[str] = field(default_factory=list)  # module names, sorted
    excluded: list[str] = field(default_factory=list)  # modules listed in exclude_modules
    bytes_before: int = 0  # tensor bytes read
    bytes_after: int = 0  # tensor bytes written
    tensors_before: int = 0
    tensors_after: int = 0

    def summary(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 0.0
        return (
            f"quantized {len(self.quantized)} tensors to NVFP4, kept {len(self.excluded)} excluded "
            f"modules dense; {_human(self.bytes_before)} -> {_human(self.bytes_after)} ({ratio:.1%})"
        )


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# planning: which tensors are quantized, which modules are listed as excluded, which share amax


@dataclass(frozen=True)
class _Plan:
    quantize: frozenset[str]  # module names
    excluded: tuple[str, ...]  # sorted module names for exclude_modules
    groups: dict[str, tuple[str, ...]]  # module -> the quantized modules sharing its scale_2
    skipped_k: tuple[str, ...]  # modules left dense because K % 16 != 0


def _matches(module: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def check_not_quantized(names: Iterable[str], dtypes: dict[str, torch.dtype] | None, where: str) -> None:
    for name in names:
        if name.endswith(_QUANT_SUFFIXES):
            raise QuantizeError(f"{where} is already quantized: it has tensor {name!r}")
        if dtypes is not None and name.endswith(".weight") and dtypes[name] == torch.uint8:
            raise QuantizeError(f"{where} is already quantized: {name!r} is uint8 (packed)")


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def plan_quantization(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype | None], exclude: Sequence[str]) -> _Plan:
    """Decide per tensor. Only float32/bf16/fp16 2-D weights are quantized; a weight of another
    dtype is kept as it is and listed as excluded."""
    quantize: set[str] = set()
    excluded: set[str] = set()
    skipped_k: list[str] = []
    for name, shape in shapes.items():
        if not name.endswith(".weight") or len(shape) < 2:
            continue
        module = name[: -len(".weight")]
        if (
            _matches(module, NEVER_QUANTIZE)
            or _matches(module, exclude)
            or len(shape) != 2
            or dtypes.get(name) not in _FLOAT_DTYPES
        ):
            excluded.add(module)
        elif shape[1] % BLOCK_SIZE != 0:
            excluded.add(module)
            skipped_k.append(module)
        else:
            quantize.add(module)
    groups: dict[str, tuple[str, ...]] = {}
    for module in quantize:
        parent, _, leaf = module.rpartition(".")
        prefix = f"{parent}." if parent else ""
        members = [module]
        for siblings in FUSED_SIBLINGS:
            if leaf in siblings:
                members = [prefix + s for s in siblings if prefix + s in quantize]
                break
        groups[module] = tuple(members)
    return _Plan(frozenset(quantize), tuple(sorted(excluded)), groups, tuple(sorted(skipped_k)))


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """amax(|w|) as float32, computed in w's dtype like ModelOpt's ``reduce_amax``."""
    return torch.maximum(w.max().abs(), w.min().abs()).float()


def check_finite(name: str, w: torch.Tensor) -> None:
    if not bool(torch.isfinite(w).all()):
        raise QuantizeError(f"tensor {name!r} has NaN or infinite values: refusing to quantize it")


def quantize_module(
    module: str, w: torch.Tensor, group_amax: torch.Tensor | None, device: torch.device, division: str
) -> dict[str, torch.Tensor]:
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise QuantizeError(f"tensor {module}.weight is {w.dtype}: only float32/bf16/fp16 weights are quantized")
    ga = None if group_amax is None else group_amax.to(device)
    packed, scale, scale_2 = quantize_nvfp4(w.to(device), ga, scale_2_division=division)
    return {
        f"{module}.weight": packed.cpu(),
        f"{module}.weight_scale": scale.cpu(),
        f"{module}.weight_scale_2": scale_2.cpu(),
        f"{module}.input_scale": torch.tensor(INPUT_SCALE, dtype=torch.float32),
    }


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def quantize_state_dict(
    state: dict[str, torch.Tensor],
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    *,
    device: str | torch.device | None = "cpu",
    scale_2_division: str = "reciprocal",
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Quantize the projections of a state dict to NVFP4 (ModelOpt tensor names and layout).

    Args:
        state: tensor name -> tensor (a Hugging Face state dict).
        exclude: fnmatch patterns over module names (tensor name less ``.weight``) to keep dense.
        device: where to compute ("cpu", "cuda", ... or None / "auto" for CUDA when present);
            results are identical on every device and returned on the CPU.
        scale_2_division: "reciprocal" (ModelOpt on a GPU, the default) or "exact" (ModelOpt
            on a CPU); see `ft.kernels.nvfp4`.

    Returns:
        (new state dict, sorted module names for ``exclude_modules``). A 2-D ``<m>.weight`` that
        is not an embedding, not excluded and has K % 16 == 0 becomes ``<m>.weight`` (uint8),
        ``<m>.weight_scale`` (float8_e4m3fn), ``<m>.weight_scale_2`` and ``<m>.input_scale``
        (float32 scalars); every other tensor is passed through unchanged. The excluded list
        holds each module whose >= 2-D weight stays dense (an embedding, excluded by pattern,
        3-D, or K not a multiple of 16).

    Raises:
        QuantizeError: the state dict is already quantized, or a weight to quantize is not
            finite or not a float32/bf16/fp16 tensor.
    """
    dtypes = {k: v.dtype for k, v in state.items()}
    check_not_quantized(state, dtypes, "the state dict")
    plan = plan_quantization({k: tuple(v.shape) for k, v in state.items()}, dtypes, tuple(exclude))
    dev = resolve_device(device)
    amaxes: dict[str, torch.Tensor] = {}

    def amax_of(module: str) -> torch.Tensor:
        if module not in amaxes:
            w = state[f"{module}.weight"]
            check_finite(f"{module}.weight", w)
            amaxes[module] = weight_amax(w.to(dev)).cpu()
        return amaxes[module]

    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or module not in plan.quantize:
            out[name] = tensor
            continue
        group = plan.groups[module]
        group_amax = torch.stack([amax_of(m) for m in group]).max() if len(group) > 1 else None
        check_finite(name, tensor)
        out.update(quantize_module(module, tensor, group_amax, dev, scale_2_division))
    return out, list(plan.excluded)


# ---------------------------------------------------------------------------------------------
# configs


def quantization_config_for(
    exclude_modules: Sequence[str], producer_version: str, quant_algo: str = QUANT_ALGO
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json content, config.json ``quantization_config``) as ModelOpt writes them.

    The second is ModelOpt's ``convert_hf_quant_config_format`` of the first (llm-compressor
    style, ``quant_method: "modelopt"``).
    """
    if quant_algo != "NVFP4":
        raise ValueError(f"only NVFP4 is supported, got {quant_algo!r}")
    excluded = sorted(exclude_modules)
    hf_quant = {
        "producer": {"name": "modelopt", "version": producer_version},
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": BLOCK_SIZE,
            "exclude_modules": excluded,
        },
    }
    group = {
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE},
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE},
        "targets": ["Linear"],
    }
    config_entry = {
        "config_groups": {"group_0": group},
        "ignore": list(excluded),
        "quant_algo": quant_algo,
        "producer": {"name": "modelopt", "version": producer_version},
        "quant_method": "modelopt",
    }
    return hf_quant, config_entry


def write_json(path: Path, data: Any, indent: int) -> None:
    path.write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")


def write_quant_config(dst: Path, exclude_modules: list[str], producer_version: str) -> dict[str, Any]:
    """Write ``DST/hf_quant_config.json`` (ModelOpt's format) and return the ``quantization_config``.

    hf_quant_config.json::

        {"producer": {"name": "modelopt", "version": producer_version},
         "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null,
                          "group_size": 16, "exclude_modules": [...sorted...]}}

    The returned dict is what ModelOpt puts under ``quantization_config`` in config.json:
    ``{"config_groups": {"group_0": {"input_activations": {...4-bit float, group 16},
    "weights": {...}, "targets": ["Linear"]}}, "ignore": [...], "quant_algo": "NVFP4",
    "producer": {...}, "quant_method": "modelopt"}``. When ``DST/config.json`` exists, its
    ``quantization_config`` is set to it as well.
    """
    dst = Path(dst)
    hf_quant, config_entry = quantization_config_for(exclude_modules, producer_version)
    write_json(dst / "hf_quant_config.json", hf_quant, indent=4)
    config_path = dst / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["quantization_config"] = config_entry
        write_json(config_path, config, indent=2)
    return config_entry
