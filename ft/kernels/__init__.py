"""Kernels, one folder per operation: `reference.py` (torch), `kernel.py` (Triton, where one
exists) and the dispatcher in its `__init__`. `backend.py` says which runs. Imports nothing from
the rest of `ft`.

Floating-point contraction: every kernel here was timed and checked with Triton's default of
fusing a multiply and an add into one FMA; Triton 3.9 warns that 3.10 turns that default off. The
default is pinned here (``TRITON_DEFAULT_FP_FUSION=1`` unless the environment already says), so a
newer Triton neither slows the kernels nor moves their roundings; the kernels that must not contract
(the HyperConnection write) say ``enable_fp_fusion=False`` at their launch."""

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
