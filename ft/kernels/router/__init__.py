"""Router top-k (softmax, top-k, optional renormalization): `reference.py`, the Triton kernel in
`kernel.py` (one launch), and this dispatcher."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.router.reference import router_topk_ref

__all__ = ["router_topk", "router_topk_ref"]


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel (`kernel.py`) on CUDA (or in interpreter tests), else `router_topk_ref`."""
    if uses_triton(logits.device) and logits.shape[-1] <= 8192:
        # NOTE: imports triton only when used
        from ft.kernels.router.kernel import router_topk_triton

        return router_topk_triton(logits, top_k, normalize)
    return router_topk_ref(logits, top_k, normalize)
