"""Steps that take far longer than their kind usually does, each logged in one line with its rows and what
the process paid for during it (`SlowSteps`).

Why: a serving run's tail (a TTFT p99, an ITL p99) is often one step, and the step's cause is often a first
time: a Triton kernel compiled (or loaded from its cache) on the request path, a CUDA graph captured, the
caching allocator taking new memory from the driver, a cache rebuild. `ft serve` on the 80B through
`bench/serve.py` (an H100, concurrency 10, 1K in / 1K out, twice in one server) ran its first level's two
mixed steps in ~980 ms each and the second level's in ~270 ms, TTFT p99 1,781 against 365 ms, and said
nothing of it (what those steps paid for is not known yet). Now such a step is a warning line (logger
"ft.engine") of the form

    slow mixed step: T ms, Rx what such a step has taken (U ms): P prompts (N tokens) beside D decoding rows;
    during it: K Triton kernels compiled or loaded (names); C CUDA graphs captured; the caching allocator took
    M MiB more from the driver (...)

and `ft_engine_slow_steps_total{kind}` counts them (`bench/serve.py` prints each level's). A line that names
nothing the engine counts ("nothing counted") points at what it cannot see: a library's first use (cuBLAS,
cuDNN), the host (the GIL, swapping), another process on the card.

What is slow: a step of at least `SLOW_MIN_S` that took `SLOW_FACTOR` times what its kind has taken of late
(decode: the median of the last `HISTORY` decode steps; prefill and mixed: their median time a token, times
the step's tokens, at least `TOKEN_FLOOR` of them, so that short chunks' fixed costs do not count as slow),
judged from `MIN_HISTORY` steps of the kind on; before that, a step of at least `SLOW_MIN_S` during which
something was paid for the first time, the caching allocator's growth alone not counting (what was paid explains a
slow step; it does not make a step that took its
usual time slow: a long prompt's loan recall is a rebuild every time). Slow steps stay out of the history. An
engine's watch starts paused: `ft serve` resumes it once it is ready (after its warm-up, whose steps are all
first times and none a user's; a warm-up on a watching engine pauses it meanwhile), so a library user's first
steps, which compile as they go, log nothing unless they resume it.

Device memory taken during a step is read two ways: the caching allocator's reserved bytes (torch's own
tensors) and the driver's count of the card's use (`cudaMemGetInfo`), whose growth beyond the allocator's is
memory taken outside torch: kernels' modules loaded on their first launch (CUDA's lazy loading: a library's
kernels load as a new shape first picks them), library workspaces, the CUDA context, the pools' own driver mappings
(`ft.memory.vmm`: a rebuild, a loan). (On a card other processes share, their allocations count there too.)
Pinned host memory is read from torch's host allocator (`torch.cuda.host_memory_stats`: the blocks it created and
the microseconds its CUDA calls took): page-locking a block is slow (tens of milliseconds for ~100 MB), and the
prefix cache's linear-attention states (`--prefix-states-on-host`) take one such block an entry.

Cost: a few integer reads a step; the memory readings (`torch.cuda.memory_stats`, a driver call and the host
allocator's statistics, tens of microseconds) at most every `MEMORY_EVERY_S` seconds and after every step of at
least `SLOW_MIN_S`, so a slow step's growth is counted since the last readings (taken at most that long before the
step began).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ft.engine.core.step_times import StepShape

log = logging.getLogger("ft.engine")

__all__ = ["MemoryReading", "SlowSteps", "StepShape", "TritonCompiles", "cuda_memory", "engine_captures",
           "triton_compiles"]

SLOW_MIN_S = 0.25
"""Shortest step that may count as slow (a decode step takes milliseconds; a whole 16K chunk under a second)."""
SLOW_FACTOR = 3.0
"""How many times its kind's usual time a step must take to count as slow without a first time to name."""
HISTORY = 64
"""Steps of a kind whose times make its usual time (the median)."""
MIN_HISTORY = 8
"""Steps of a kind before its usual time is trusted."""
TOKEN_FLOOR = 1024
"""Fewest tokens a prefill or mixed step is charged (a short chunk costs about what a 1K one does)."""
MEMORY_EVERY_S = 0.25
"""Least time between two memory readings (`MemoryReading`) outside slow steps."""


@dataclass(frozen=True)
class MemoryReading:
    """Cumulative memory figures of a process on its device, in bytes, blocks and microseconds."""

    reserved: int  # torch's caching allocator's reserved bytes
    used: int  # the driver's count of the card's use (total - free)
    host_blocks: int = 0  # pinned host blocks torch's host allocator created so far
    host_alloc_us: float = 0.0  # microseconds its CUDA calls took creating them


KEPT_COMPILES = 1024
"""Compiles whose name and specialization `TritonCompiles` keeps (the newest; the count goes on past them)."""


class TritonCompiles:
    """The Triton kernels compiled (or loaded from Triton's cache) in this process since the hook went in: Triton's
    `knobs.runtime.jit_post_compile_hook`, chained to any hook set before it. Installed once per process;
    `available` is False where this Triton has no such hook (compiles then go uncounted). `count`: compiles so
    far; `since(n)`: (name, signature) of compile n onwards, of the newest `KEPT_COMPILES`. A signature is the
    compile as Triton writes it (its options and each argument's specialization, such as `*bf16D`: a pointer
    aligned to 16 bytes), what tells two compiles of one kernel apart, logged at debug level with a slow step's
    line. The hook may run on a compile thread: `record` takes a lock."""

    def __init__(self) -> None:
        self.count = 0
        self.available: bool | None = None  # None: not tried yet
        self._kept: deque[tuple[str, str]] = deque(maxlen=KEPT_COMPILES)
        self._lock = threading.Lock()

    def record(self, name: str, signature: str = "") -> None:
        """One compile of kernel `name`."""
        with self._lock:
            self._kept.append((name, signature))
            self.count += 1

    def since(self, index: int) -> list[tuple[str, str]]:
        """(name, signature) of compiles `index`, `index` + 1, ... that are still kept, in order."""
        with self._lock:
            kept, first = list(self._kept), self.count - len(self._kept)
        return kept[max(index - first, 0):]

    def install(self) -> bool:
        with self._lock:
            if self.available is not None:
                return self.available
            try:
                import triton
            except ImportError:
                self.available = False
                return False
            knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
            if knobs is None or not hasattr(knobs, "jit_post_compile_hook"):
                self.available = False
                return False
            before = knobs.jit_post_compile_hook

            def compiled(*args, **kwargs):
                info = kwargs.get("fn")
                self.record(str(getattr(info, "name", None) or "a kernel"), compile_signature(kwargs))
                return before(*args, **kwargs) if before is not None else False

            knobs.jit_post_compile_hook = compiled
            self.available = True
            return True


def compile_signature(hook_kwargs: dict) -> str:
    """One compile as Triton's `jit_post_compile_hook` describes it, in a line: the kernel and its launch options
    (Triton's own `repr`, up to its argument list), each argument's type, the constants it was compiled for (the
    constexprs, and integers specialized to their value) and the arguments specialized as divisible by 16 (a
    pointer aligned to 16 bytes, an integer multiple of 16). Triton's `repr` alone, where its `compile` details are
    missing or not as expected."""
    text = str(hook_kwargs.get("repr") or "")
    try:
        details = hook_kwargs["compile"]
        types = dict(details["signature"])
        names = list(types)

        def named(key) -> str:
            return names[key[0]] if isinstance(key, tuple) and len(key) == 1 and key[0] < len(names) else str(key)

        constants = {named(k): v for k, v in dict(details.get("constants") or {}).items()}
        attrs = (details.get("configs") or [{}])[0] or {}
        divisible = [named(k) for k, v in dict(attrs).items() if "divisibility" in str(v)]
    except (KeyError, TypeError, AttributeError, IndexError):
        return text
    arguments = ", ".join(f"{n}: {t}" for n, t in types.items() if n not in constants)
    fixed = ", ".join(f"{n}={getattr(v, '__name__', v)}" for n, v in constants.items())
    return f"{text.split('(', 1)[0]}({arguments}; constants {fixed or 'none'}; divisible by 16: " \
           f"{', '.join(divisible) or 'none'})"


triton_compiles = TritonCompiles()
"""The process's count of Triton compiles (`TritonCompiles`)."""


@dataclass(frozen=True)
class _Mark:
    """What was counted when a step began."""

    compiles: int
    captures: int
    rebuilds: int
    memory: MemoryReading | None  # at the last reading (None: off CUDA)
    memory_at: float


class SlowSteps:
    """The watch over one engine's steps (engine thread only): `mark(captures, history)` before a step,
    `end(kind, seconds, shape, mark, captures, history)` after it, which returns the warning line of a slow step
    (or None) and counts it by kind in `count`. `captures`: the CUDA graphs the engine captured so far (decode and
    prefill, `engine_captures`); `history`: its cache's rebuild history (dicts with "trigger" and "status"),
    passed at each call rather than held, so that the watch keeps no reference to its engine. `device`: on CUDA,
    Triton's compiles are counted and `read_memory` defaults to `cuda_memory`; elsewhere nothing is read unless
    `read_memory` is given."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter,
                 read_memory: Callable[[], MemoryReading] | None = None) -> None:
        self.device, self.clock = device, clock
        self.count = {"decode": 0, "mixed": 0, "prefill": 0}
        self.paused = False
        self._decode: deque[float] = deque(maxlen=HISTORY)  # seconds a decode step
        self._token: deque[float] = deque(maxlen=HISTORY)  # seconds a token, prefill and mixed steps
        self._cuda = device.type == "cuda"
        if self._cuda:
            triton_compiles.install()
        if read_memory is None and self._cuda:
            read_memory = lambda: cuda_memory(device)  # noqa: E731
        self._read_memory = read_memory
        self._memory: MemoryReading | None = read_memory() if read_memory is not None else None
        self._memory_at = clock()

    def pause(self) -> None:
        """Judge no step until `resume` (the warm-up)."""
        self.paused = True

    def resume(self) -> None:
        """Judge steps again, from a history of none (what came before was no user's)."""
        self.paused = False
        self._decode.clear()
        self._token.clear()
        if self._read_memory is not None:
            self._memory, self._memory_at = self._read_memory(), self.clock()

    def mark(self, captures: int = 0, history: Sequence[dict] = ()) -> _Mark:
        return _Mark(triton_compiles.count, captures, len(history), self._memory,
                     self._memory_at)

    def end(self, kind: str, seconds: float, shape: StepShape, mark: _Mark, captures: int = 0,
            history: Sequence[dict] = ()) -> str | None:
        """Account a step that began at `mark` and took `seconds`; the warning line if it was slow."""
        if self.paused:
            return None
        now = self.clock()
        if self._read_memory is not None and (seconds >= SLOW_MIN_S or now - self._memory_at >= MEMORY_EVERY_S):
            self._memory, self._memory_at = self._read_memory(), now
        usual, paid, slow = None, [], False
        if seconds >= SLOW_MIN_S:  # (the usual time and the counters are read for these steps only)
            usual = self._usual(kind, shape)
            paid, first_time = self._paid(mark, captures, history)
            # with a usual time the time decides (what was paid explains); before one, a first time does
            slow = seconds >= SLOW_FACTOR * usual if usual is not None else first_time
        if not slow:
            if kind == "decode":
                self._decode.append(seconds)
            else:
                self._token.append(seconds / max(shape.tokens, TOKEN_FLOOR))
            return None
        self.count[kind] = self.count.get(kind, 0) + 1
        than = (f"{seconds / usual:.1f}x what such a step has taken ({usual * 1e3:,.0f} ms)" if usual
                else "no usual time yet")
        return (f"slow {kind} step: {seconds * 1e3:,.0f} ms, {than}: {shape.text()}; during it: "
                f"{'; '.join(paid) if paid else self._nothing()}")

    def _usual(self, kind: str, shape: StepShape) -> float | None:
        if kind == "decode":
            return statistics.median(self._decode) if len(self._decode) >= MIN_HISTORY else None
        if len(self._token) < MIN_HISTORY:
            return None
        return statistics.median(self._token) * max(shape.tokens, TOKEN_FLOOR)

    def _paid(self, mark: _Mark, captures: int, history: Sequence[dict]) -> tuple[list[str], bool]:
        """(what the step paid for, as phrases; whether any of it is a first time that costs: a compile, a capture,
        a rebuild, memory taken outside torch's allocator, pinned host blocks). The caching allocator's growth
        alone is no such first time: a step with more tokens than any before takes more memory at no cost to speak
        of (session 60: a 10-prompt prefill at its usual rate flagged for 160 MiB)."""
        out, allocator = [], None
        compiled = triton_compiles.count - mark.compiles
        if compiled > 0:
            kept = triton_compiles.since(mark.compiles)
            shown = ", ".join(dict.fromkeys(name for name, _ in kept))  # (distinct, in order)
            out.append(f"{compiled} Triton kernel{'s' * (compiled != 1)} compiled or loaded ({shown})")
            for _, signature in kept:
                log.debug("compiled in a slow step: %s", signature)
        captured = captures - mark.captures
        if captured > 0:
            out.append(f"{captured} CUDA graph{'s' * (captured != 1)} captured")
        for entry in history[mark.rebuilds:]:
            out.append(f"a {entry.get('trigger', '?')} rebuild ({entry.get('status', '?')})")
        before, now = mark.memory, self._memory
        if before is not None and now is not None:
            torch_mib = (now.reserved - before.reserved) / 2**20
            other_mib = (now.used - before.used) / 2**20 - max(torch_mib, 0.0)
            apart = (f"in the {(self._memory_at - mark.memory_at) * 1e3:,.0f} ms between two readings, this step "
                     "included")
            if torch_mib >= 1:
                out.append(f"the caching allocator took {torch_mib:,.0f} MiB more from the driver ({apart})")
                allocator = out[-1]
            if other_mib >= 1:
                out.append(f"{other_mib:,.0f} MiB more of the card went outside torch's allocator (kernel modules "
                           f"loaded on first use, library workspaces, the pools' own mappings; {apart})")
            blocks = now.host_blocks - before.host_blocks
            if blocks > 0:
                took = (now.host_alloc_us - before.host_alloc_us) / 1e3  # (0 where this torch does not time them)
                out.append(f"{blocks} pinned host block{'s' * (blocks != 1)} created"
                           + (f", {took:,.0f} ms in their CUDA calls" if took > 0 else "") + f" ({apart})")
        return out, any(item is not allocator for item in out)

    def _nothing(self) -> str:
        counted = "compile, capture, allocation or rebuild" if triton_compiles.available or not self._cuda \
            else "capture, allocation or rebuild (this Triton reports no compiles)"
        return f"nothing counted (no {counted}: a library's first use, the host, or another process?)"


def cuda_memory(device: torch.device) -> MemoryReading:
    """The `MemoryReading` of this process on CUDA `device` (the host allocator's figures 0 where this torch has no
    `torch.cuda.host_memory_stats` or it lacks them)."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return MemoryReading(int(torch.cuda.memory_reserved(device)), int(total - free),
                         int(stats.get("num_host_alloc", 0)), float(stats.get("host_alloc_time.total", 0.0)))


def engine_captures(engine: Any) -> int:
    """CUDA graphs an engine's runner captured so far, decode and prefill."""
    runner = engine.runner
    return sum(getattr(g, "captures", 0) for g in (getattr(runner, "graphs", None),
                                                   getattr(runner, "prefill_graphs", None)) if g is not None)
