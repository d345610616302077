"""One log line per cache history entry (rebuilds, ladder moves, refusals): what `ft serve`
prints so that an operator reading the server log sees every change of geometry and its reason."""

from __future__ import annotations

from ft.units import format_bytes

POOL_ORDER = ("moe", "kv", "mamba")


def change(before: dict[str, int], after: dict[str, int]) -> str:
    """'kv 4096->8192 moe 343->115' (pools that did not change are left out; 'no change')."""
    parts = [f"{p} {before[p]}->{after[p]}" for p in POOL_ORDER if p in before and p in after and before[p] != after[p]]
    return " ".join(parts) or "no change"


def history_line(entry: dict) -> str:
    """A history entry (`CacheManager.history`) as one line:
    'rebuild #3 (ladder: grow to rung 2 ...): kv 4096->8192 moe 343->115: ok in 0.12 s, peak 28.6 MiB'."""
    trigger, reason = entry["trigger"], entry.get("reason")
    head = f"rebuild #{entry['id']} ({trigger}{': ' + reason if reason else ''})"
    if trigger == "startup":
        sizes = " ".join(f"{p} {entry['to'][p]}" for p in POOL_ORDER if p in entry["to"])
        return f"{head}: {sizes}, {format_bytes(entry['peak_bytes'])}"
    status = entry["status"]
    took = (entry.get("phases") or {}).get("total_s", 0.0)
    tail = f"{status} in {took:.2f} s, peak {format_bytes(entry['peak_bytes'])}"
    if status != "ok" and entry.get("error"):
        tail = f"{status}: {entry['error']}"
    return f"{head}: {change(entry['from'], entry['to'])}: {tail}"
