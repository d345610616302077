"""L2 prefetch hints (sm_90): ``cp.async.bulk.prefetch.L2`` asks L2 for a contiguous byte range and returns at once
(no registers, no wait). A kernel whose programs stream a few KB each,
a few programs an SM, is latency-bound on HBM; asking for its whole range first puts every byte in flight from its
start, and its loads then wait on L2. The NVFP4 decode tiles (`Nvfp4Options.dot_prefetch_l2`) and the decode MoE's
passes (`MoeOptions.decode_prefetch_ahead`, `decode_down_prefetch_ahead`) take it, each asking only for bytes of the
tensors it reads.

`prefetch_l2` is elementwise over tensors of byte addresses and lengths (a range of 0 bytes asks for nothing);
each address and length must be a multiple of 16 (`bulk_prefetch_aligned` checks a launch's tensors on the host).
Inline PTX: CUDA only (`ft.kernels.backend.inline_ptx`), never in the interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bulk_prefetch_aligned", "prefetch_l2"]

_PREFETCH_PTX = tl.constexpr("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\n"
                              "mov.u32 $0, 0;\n}")


@triton.jit
def prefetch_l2(addr, nbytes):
    """Ask L2 for [addr, addr + nbytes) (int64 byte addresses and int32 lengths, any shape; 0 bytes: none)."""
    tl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def bulk_prefetch_aligned(device: torch.device, *sizes_in_bytes: int) -> bool:
    """Whether a launch on `device` may ask for ranges built from these byte counts (base addresses, strides and
    lengths): a device of compute capability >= 9.0 and every count a multiple of 16."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and all(int(s) % 16 == 0 for s in sizes_in_bytes))
