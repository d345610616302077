"""Which implementation the dispatchers run: Triton or the torch reference.

Triton runs for tensors on CUDA, and on the CPU only in interpreter tests, which ask for it with
both ``FT_TRITON_INTERPRET_TEST=1`` and ``TRITON_INTERPRET=1`` (triton reads the latter once, at
import). Everything else runs the torch references; inside `reference_kernels()` everything does,
CUDA included (the other side of an end-to-end check of the kernels).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the Triton kernels take."""


_reference_depth = 0
"""How many `reference_kernels()` blocks are open (nested blocks stack)."""


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Inside: every dispatcher runs its torch reference, on CUDA too (no Triton kernel, no library
    attention path). For checks of the kernels end to end: an engine built and run inside computes with
    the references alone; build it with CUDA graphs off (the references may read values on the host).
    Not thread-aware: the engine must run in the thread that opened the block."""
    global _reference_depth
    _reference_depth += 1
    try:
        yield
    finally:
        _reference_depth -= 1


def reference_kernels_forced() -> bool:
    """Whether a `reference_kernels()` block is open."""
    return _reference_depth > 0


def uses_triton(device: torch.device) -> bool:
    """Whether the dispatchers run Triton for tensors on `device` (never inside `reference_kernels()`)."""
    if _reference_depth:
        return False
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
