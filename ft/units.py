"""Byte sizes as users write and read them ("64MiB", "16GB", "1.3 GiB"). No torch import."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'64MiB' -> 67108864; '16GB' -> 16e9; '16g' -> 16 GiB; a plain number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 64MiB, 16GB, 24g, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """1395864371 -> '1.3 GiB'; 925138534 -> '882.3 MiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def seconds_arg(lo: float, hi: float | None = None, above: bool = False):
    """An argparse type for seconds in [lo, hi] (or (lo, hi] with above=True); hi None: no cap."""
    import argparse

    def parse(text: str) -> float:
        try:
            s = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if (s <= lo if above else s < lo) or (hi is not None and s > hi):
            if hi is None:
                raise argparse.ArgumentTypeError(f"must be more than {lo:g} seconds, got {text}")
            raise argparse.ArgumentTypeError(f"must be between {lo:g} and {hi:g} seconds, got {text}")
        return s

    return parse


def host_plan_text(parts: dict[str, int], available_bytes: int | None, available_from: str = "") -> str:
    """"routed experts 63.3 GiB, embedding 1.2 GiB of 124.1 GiB available (MemAvailable) before loading": what a
    server keeps in host memory (`ft.memory.host_memory.HostPlan`) against what the host had; "" with no parts."""
    text = ", ".join(f"{what} {format_bytes(n)}" for what, n in parts.items() if n)
    if text and available_bytes is not None:
        text += f" of {format_bytes(available_bytes)} available ({available_from}) before loading"
    return text


def host_tables_text(tables: dict[str, int], total: int) -> str:
    """"n-gram table 95.4 GiB, embedding 1.2 GiB" from {what: bytes}; a server that sends only the total
    (before `host_tables`): "tables 95.4 GiB"."""
    if not tables:
        return f"tables {format_bytes(total)}"
    return ", ".join(f"{what} {format_bytes(n)}" for what, n in tables.items())
