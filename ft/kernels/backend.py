"""Which implementation the dispatchers run: Triton or the torch reference.

Triton runs for tensors on CUDA, and on the CPU only in interpreter tests, which ask for it with
both ``FT_TRITON_INTERPRET_TEST=1`` and ``TRITON_INTERPRET=1`` (triton reads the latter once, at
import). Everything else runs the torch references.
"""

from __future__ import annotations

import functools
import os

import torch

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the Triton kernels take."""


def uses_triton(device: torch.device) -> bool:
    """Whether the dispatchers run Triton for tensors on `device`."""
    if device.type == "cuda":
        return True
    return os.environ.get("FT_TRITON_INTERPRET_TEST") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def inline_ptx(device: torch.device) -> bool:
    """Whether kernels launched for `device` may run inline PTX (`tl.inline_asm_elementwise`): on a
    CUDA device, not in Triton's interpreter (which cannot run it; the kernels then take a plain
    Triton stand-in computing the same values)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA `device` (cached; 0 off CUDA: no occupancy to size for)."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def debug_checks() -> bool:
    """Whether ``FT_DEBUG=1``: the kernels' callers then check what the kernels assume (device syncs)."""
    return os.environ.get("FT_DEBUG") == "1"
