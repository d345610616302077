"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while
the kernel before it in the stream is still running, and waits (`pdl_wait`, PTX
``griddepcontrol.wait``) for that kernel's completion and its memory before it touches anything
that kernel, or any earlier one, may write. A kernel lets the next one start early with
`pdl_release` (``griddepcontrol.launch_dependents``; without it, the next one starts when it ends).
Inside a CUDA graph the launches keep their programmatic edges.

What it buys in a decode step of ~600 small kernels: the next kernel's launch and its programs'
start overlap the tail of the one before, and the work a kernel does before its wait (the NVFP4
GEMV loads its weights there: they depend on no kernel of the step) overlaps it too.

The contract every kernel launched with PDL keeps (`pdl_args`): every program runs
`pdl_wait` before its first load of data a kernel of the step writes and before its first store,
with no early return before it. Then a kernel's completion implies its predecessor's, so a kernel
launched without PDL after it sees everything before it, as with plain launches.

Where: the small test model's graphs capture and replay with it, bitwise equal to plain launches
(`tests/gpu/test_decode_graphs_cuda.py`); switching it on and off in one process captures again in a
new pool each time (`DecodeGraphs.invalidate`: session 18's allocator assertion came from reusing the old
pool; confirmed on the H200 in session 34). Measured against plain launches in one process
(`bench/decode.py --modes overlap,pdl,overlap,pdl`, bench/RESULTS.md): in session 34 on the H200 the 80B
0.96x at batch 1, 1.02x at 8, 1.00x at 64; in session 41 on the H100, once every kernel of Qwen3.8-Flash-
Next's step took it (the HyperConnection's, QSA's, the sparse decode attention, the Engram's, the slot
writes, the activations), Flash-Next +9% at batch 1 and +3% at 8; the 80B -6% at 1, a tie at 4 and 8,
-1.5% at 16, -2% at 32. So each model says whether its decode graphs capture with it (`decode_graph_pdl`), and `LaunchOptions.pdl`
None (the default) leaves eager launches and prefill plain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.backend import inline_ptx
from ft.kernels.options import kernel_options

try:  # triton >= 3.4 (the device's 3.6 has it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL stays off (`pdl_on`)
    gdc_launch_dependents = gdc_wait = None

__all__ = ["pdl_args", "pdl_on", "pdl_release", "pdl_wait"]

# on or off: `ft.kernels.options.LaunchOptions.pdl` (None: only inside the decode graphs of a model that
# chooses it, `ft.engine.worker.decode_graphs`)


def pdl_on(device: torch.device) -> bool:
    """Whether kernels for `device` launch with PDL: `LaunchOptions.pdl` True (None is off here: the
    decode graphs put True in force around their captures where the model chooses it), a CUDA device
    (not the interpreter) of compute capability >= 9.0, and a Triton that has the instructions."""
    return (kernel_options().launch.pdl is True and gdc_wait is not None and inline_ptx(device)
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_args(device: torch.device) -> dict:
    """A launch's keywords for a kernel that takes a ``PDL`` constexpr (default off): with PDL on for
    `device`, the constexpr and the launch option; else none (the interpreter takes no such option)."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(device) else {}


@triton.jit
def pdl_wait(ON: tl.constexpr):
    """With ON (the kernel was launched with PDL): wait for the kernel before it to complete, its
    stores visible. Every program of such a kernel runs it before touching the step's data."""
    if ON:
        gdc_wait()


@triton.jit
def pdl_release(ON: tl.constexpr):
    """With ON: the next kernel (launched with PDL) may start once every program of this one ran
    this (it still waits for this kernel's end before it reads what this kernel writes)."""
    if ON:
        gdc_launch_dependents()
