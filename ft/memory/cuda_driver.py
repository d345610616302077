"""The CUDA driver API through cuda-python's bindings (`cuda.bindings.driver`), imported lazily so that the
modules using it import on a machine with no CUDA at all: the loader, and one way to unwrap a call's result.
Users: `ft.memory.vmm` (virtual memory management), `ft.memory.host_flag` (stream memory operations)."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["DriverError", "call", "driver", "unwrap"]

_DRIVER: Any = None


class DriverError(RuntimeError):
    """A CUDA driver call failed; `code` is the driver's error name (e.g. CUDA_ERROR_OUT_OF_MEMORY)."""

    def __init__(self, call: str, code: str):
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code


def driver():
    """The cuda-python driver module (new layout first, the pre-12.6 `cuda.cuda` second)."""
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver as module
        except ImportError:
            from cuda import cuda as module  # type: ignore[no-redef]
        _DRIVER = module
    return _DRIVER


def _error_name(drv, err) -> str:
    with contextlib.suppress(Exception):  # naming the error must never mask it
        res = drv.cuGetErrorName(err)
        if res[0] == drv.CUresult.CUDA_SUCCESS and res[1]:
            name = res[1]
            return name.decode() if isinstance(name, bytes) else str(name)
    return getattr(err, "name", str(err))


def unwrap(call: str, result, error: type[DriverError] = DriverError, drv=None):
    """A cuda-bindings (err, *values) tuple (or a bare error) -> its value(s); `error` naming the driver's
    error when the call failed. `drv`: the bindings module (`driver()` by default; tests pass a stand-in)."""
    drv = drv if drv is not None else driver()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise error(call, _error_name(drv, err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(name: str, *args):
    """driver().<name>(*args), unwrapped (`unwrap`)."""
    return unwrap(name, getattr(driver(), name)(*args))
