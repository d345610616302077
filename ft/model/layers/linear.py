"""Linear projections whose weight is dense or NVFP4 (ModelOpt layout)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ft.kernels.dense import dense_linear
from ft.kernels.nvfp4 import dequantize_nvfp4, nvfp4_linear


@dataclass
class NVFP4Weight:
    """packed uint8 [N, K/2] (even element in the low nibble), scale e4m3 [N, K/16], scale_2 f32 [].

    scale_2_host: scale_2's value as a float, read once when the weight is made (a sync if scale_2
    is on a GPU: weights are made while a model loads, never inside a step); the prefill linear
    passes it to cuBLAS (`ft.kernels.nvfp4.DEQUANT_MM_MIN_M`)."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor
    scale_2_host: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.scale_2_host = float(self.scale_2)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.scale_2))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.scale_2, dtype)


def weight_nbytes(w: torch.Tensor | NVFP4Weight) -> int:
    """A weight's bytes (an NVFP4 weight's: its packed values and scales)."""
    return w.nbytes if isinstance(w, NVFP4Weight) else w.numel() * w.element_size()


class Linear:
    """y = x @ W^T with W [N, K] dense (any float dtype) or NVFP4."""

    def __init__(self, weight: torch.Tensor | NVFP4Weight) -> None:
        self.weight = weight

    @property
    def nbytes(self) -> int:
        return weight_nbytes(self.weight)

    @staticmethod
    def stacked(weights: list[torch.Tensor | NVFP4Weight]) -> "Linear":
        """One projection whose output rows are those of `weights` in order (y = [x W_0^T | x W_1^T ...]):
        dense weights concatenated; NVFP4 ones too when they share their global scale (scale_2), which
        keeps every value exact. NVFP4 weights of different global scales raise ValueError (folding
        the ratio into the e4m3 block scales would round them)."""
        if not any(isinstance(w, NVFP4Weight) for w in weights):
            return Linear(torch.cat(weights))
        if not all(isinstance(w, NVFP4Weight) for w in weights):
            raise ValueError("cannot stack NVFP4 and dense projections into one")
        if len({w.scale_2_host for w in weights}) > 1:
            raise ValueError(f"cannot stack NVFP4 projections of different global scales "
                             f"{sorted({w.scale_2_host for w in weights})}")
        return Linear(NVFP4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scale for w in weights]),
                                  weights[0].scale_2))

    def with_rows(self, order: torch.Tensor) -> "Linear":
        """The same projection with its output rows reordered: y'[..., i] = y[..., order[i]]
        (each output is the same dot product, so the values are the same)."""
        w = self.weight
        if isinstance(w, NVFP4Weight):  # rows carry their block scales; the global scale is shared
            return Linear(NVFP4Weight(w.packed[order].contiguous(), w.scale[order].contiguous(), w.scale_2))
        return Linear(w[order].contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, NVFP4Weight):
            shape = x.shape
            y = nvfp4_linear(x.reshape(-1, shape[-1]), w.packed, w.scale, w.scale_2, w.scale_2_host)
            return y.reshape(*shape[:-1], -1)
        shape = x.shape
        return dense_linear(x.reshape(-1, shape[-1]), w).reshape(*shape[:-1], -1)


class ProjectionGroup:
    """Projections of one input computed in one launch where their weights allow it (`Linear.stacked`:
    dense ones, or NVFP4 ones sharing their global scale, as ModelOpt quantizes a layer's q / k / v),
    else one by one. __call__(x [..., K]) -> their outputs in order (views of one tensor when stacked:
    strided along rows, unit stride along the last dimension)."""

    def __init__(self, linears: list[Linear]) -> None:
        self.widths = [lin.weight.shape[0] for lin in linears]
        try:
            self.stacked: Linear | None = Linear.stacked([lin.weight for lin in linears])
            self.parts: list[Linear] = []
        except ValueError:  # NVFP4 weights of different global scales: each its own launch
            self.stacked, self.parts = None, list(linears)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.stacked is None:
            return [lin(x) for lin in self.parts]
        return list(torch.split(self.stacked(x), self.widths, dim=-1))
