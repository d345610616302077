"""Which exceptions mean the device is lost: a CUDA error that poisons the context (an illegal address,
a device-side assert, a launch failure) leaves every later kernel launch failing, so the server must
not go on as if one step had failed (`ft.server.engine_loop` fails every request, answers /health 503
and makes `ft serve` exit non-zero, for a supervisor to restart it). Out-of-memory and shape errors
are not faults: the next step can run."""

from __future__ import annotations

import torch

__all__ = ["STICKY_CUDA_ERRORS", "device_fault"]

STICKY_CUDA_ERRORS = (
    "illegal memory access", "illegal address", "illegal instruction", "misaligned address",
    "unspecified launch failure", "device-side assert", "launch timed out", "uncorrectable ecc error",
    "hardware stack error", "an exception occurred on the device", "cudaerrorillegaladdress",
    "cuda_error_illegal_address", "cudaerrorlaunchfailure", "cuda_error_launch_failed",
)
"""Lower-case fragments of the messages of CUDA errors after which the context is unusable (CUDA's
"sticky" errors: cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
cudaErrorIllegalInstruction, cudaErrorMisalignedAddress, cudaErrorLaunchTimeout, cudaErrorECCUncorrectable,
cudaErrorHardwareStackError), as torch, Triton ("Triton Error [CUDA]: ...") and cuda-bindings word them."""


def device_fault(exc: BaseException) -> str | None:
    """The reason, one line, when `exc` (or an exception it was raised from) is a CUDA error that loses the
    context; None for anything else (torch.OutOfMemoryError included: memory can be freed)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not isinstance(e, torch.OutOfMemoryError):
            text = str(e)
            low = text.lower()
            if any(fragment in low for fragment in STICKY_CUDA_ERRORS):
                first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
                return f"{type(e).__name__}: {first}"[:300]
        e = e.__cause__ or e.__context__
    return None
