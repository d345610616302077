"""FreeToken's exceptions, in one module that imports nothing. Each message names the problem."""


class FreeTokenError(Exception):
    """Base class of FreeToken's own errors."""


class CheckpointError(FreeTokenError, ValueError):
    """A checkpoint is malformed: a missing or unexpected tensor, a wrong shape, a bad file."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or quantization is not one FreeToken runs."""


class ConfigError(FreeTokenError, ValueError):
    """Engine options contradict each other or the memory budget."""


class RequestError(FreeTokenError, ValueError):
    """A request cannot be served as given (too long for the context, bad parameters)."""


class RebuildRefused(FreeTokenError, ValueError):
    """A resize target outside the reachable ranges: refused before any memory is touched.
    `ranges` maps each pool to its (min, max) at the time of the refusal."""

    def __init__(self, reason: str, ranges: dict[str, tuple[int, int]]) -> None:
        shown = ", ".join(f"{p} {lo}..{hi}" for p, (lo, hi) in ranges.items())
        super().__init__(f"{reason}; reachable ranges: {shown}")
        self.reason = reason
        self.ranges = ranges


class RebuildFailed(FreeTokenError, RuntimeError):
    """A rebuild failed and was rolled back; `step` names the step, the cause is chained.
    `degraded` is set when the rollback itself failed: the pools then hold what the engine reports
    (never a stale geometry), and the text says what could not be restored."""

    def __init__(self, step: str, cause: BaseException, degraded: str | None = None) -> None:
        msg = f"step '{step}' failed: {type(cause).__name__}({cause})"
        if degraded:
            msg += f"; the rollback did not complete: {degraded}"
        super().__init__(msg)
        self.step = step
        self.degraded = degraded


class InjectedFault(RuntimeError):
    """Raised on purpose by tests at a named rebuild step, inside its inverse, or in one tensor's resize."""


class RanksOutOfStep(RuntimeError):
    """Rank 0 of a tensor-parallel engine failed a step after the workers started it: they wait
    in a collective rank 0 will not join, and the group cannot be trusted again."""


class DeviceFailed(FreeTokenError, RuntimeError):
    """The GPU failed in an engine step with an error that loses its CUDA context (an illegal memory
    access, a device-side assert): no later step can run, so the server fails every request and exits
    non-zero for a supervisor to restart it. `reason` is the CUDA error, one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the GPU failed in an engine step and cannot run another: {reason}")
        self.reason = reason
