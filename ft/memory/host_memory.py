"""Host memory: what a model keeps there, against what the host has, checked before the weights load.

A model for a card too small for it keeps its routed experts in host memory (pinned beside a GPU), and
Qwen3.8-Flash-Next its n-gram table too: 63 GiB and 95 GiB of its NVFP4 checkpoint, against the seed's
123 GB of RAM. Pinned memory cannot be swapped or reclaimed: a host without room for it ends the load
minutes in (a failed `cudaHostAlloc`) or has the kernel's OOM killer end the process without a word.
`HostPlan.check` refuses at once, in one line, with the figures. (An n-gram table that does not fit is
mapped from the checkpoint's files instead where `--ngram-table auto` may: `ft.model.paged_table`.)

What the host has (`available_bytes`): the kernel's MemAvailable (free memory plus what it can reclaim,
page cache included), or less where the process's cgroup (a container's limit) leaves less.
Torch-free: read by the engine before it loads, and by tests anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ft.errors import ConfigError
from ft.units import format_bytes, host_plan_text

__all__ = ["HOST_MARGIN", "HostPlan", "available_bytes"]

HOST_MARGIN = 2 << 30
"""Bytes left to the rest of the process beside the planned tables (the interpreter, torch's CPU
allocations, the tokenizer, a checkpoint piece being read, and the prefix cache's states kept in host
memory: at most max(4, running requests) mamba slots, ~0.9 GiB for Qwen3.8-Flash-Next at 8)."""

MEMINFO = Path("/proc/meminfo")
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) or absent: no limit


def _cgroup_left(v2: Path, v1: Path) -> int | None:
    """What the process's cgroup still allows (its limit less its usage), None without a limit. (The
    root's files: a container sees its own cgroup there.)"""
    limit, used = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None:
        limit, used = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        if limit is not None and limit >= 1 << 60:  # v1's "no limit" is a huge number
            limit = None
    if limit is None:
        return None
    return max(0, limit - (used or 0))


def available_bytes(meminfo: Path = MEMINFO, cgroup_v2: Path = CGROUP_V2, cgroup_v1: Path = CGROUP_V1
                    ) -> tuple[int, str] | None:
    """(bytes the host can still give this process, where the figure comes from: "MemAvailable" or "the
    cgroup's limit"), the smaller of the two; None where neither can be read (not Linux)."""
    found = [(b, why) for b, why in ((_meminfo_available(meminfo), "MemAvailable"),
                                     (_cgroup_left(cgroup_v2, cgroup_v1), "the cgroup's limit")) if b is not None]
    return min(found) if found else None


@dataclass(frozen=True)
class HostPlan:
    """What a model keeps in host memory ({what: bytes}, e.g. "routed experts", "n-gram table",
    "embedding") and what the host had before it loaded (`available_bytes`, None: unknown)."""

    parts: dict[str, int]
    available: tuple[int, str] | None

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def parts_text(self) -> str:
        """"routed experts 63.0 GiB, n-gram table 95.4 GiB"."""
        return host_plan_text(self.parts, None)

    def fits(self, margin: int = HOST_MARGIN) -> bool:
        return self.available is None or self.total + margin <= self.available[0]

    def check(self, margin: int = HOST_MARGIN) -> None:
        """Raise ConfigError (one line, the figures and the way past it) when the planned tables and
        `margin` do not fit what the host has."""
        if self.fits(margin):
            return
        have, source = self.available
        raise ConfigError(
            f"host memory: this model keeps {format_bytes(self.total)} in host memory ({self.parts_text()}), "
            f"and this host has {format_bytes(have)} available ({source}), {format_bytes(margin)} of which the rest "
            f"of the process needs: the load would fail or be killed part way. Free host memory"
            + (", or read the n-gram table from the checkpoint's files (--ngram-table disk)" if "n-gram table" in
               self.parts else "")
            + ", or pass --no-host-memory-check to load anyway")
