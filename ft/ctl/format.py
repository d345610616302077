"""Plain-text views of the admin API's answers, shared by `ft ctl` and `ft top`.

Pure functions of the schema objects: no I/O, no clock reads except turning a history entry's
unix time into local HH:MM:SS. Sizes read as users write them: moe and mamba in slots, kv in
tokens; bytes through `ft.units.format_bytes`.
"""

from __future__ import annotations

import time

from ft.schemas import CacheState, DeviceState, History, HistoryEntry, LadderState, RequestList, ResizePlan
from ft.units import format_bytes, host_plan_text, host_tables_text

POOL_ORDER = ("moe", "kv", "mamba")


def format_range(lo: int, hi: int) -> str:
    """The reachable sizes of a pool: (512, 1843) -> '512..1843'."""
    return f"{lo}..{hi}"


def _ordered(keys) -> list[str]:
    keys = list(keys)
    return [k for k in POOL_ORDER if k in keys] + sorted(k for k in keys if k not in POOL_ORDER)


def format_geometry(d: dict[str, int]) -> str:
    """Pool sizes, moe then kv then mamba: {'kv': 65536, 'moe': 1024} -> 'moe 1024 kv 65536'."""
    return " ".join(f"{k} {d[k]}" for k in _ordered(d)) if d else "-"


def format_change(before: dict[str, int], after: dict[str, int]) -> str:
    """What a rebuild changed: 'moe 512->1024 kv 262144->65536' (pools it left alone are omitted).

    A pool without a previous size (the startup build) shows its size alone."""
    parts = []
    for k in _ordered(set(before) | set(after)):
        if k not in after:
            continue
        if k not in before:
            parts.append(f"{k} {after[k]}")
        elif before[k] != after[k]:
            parts.append(f"{k} {before[k]}->{after[k]}")
    return " ".join(parts) if parts else "no change"


def format_signed_bytes(n: int) -> str:
    """+1.3 GiB / -882.3 MiB / 0 B."""
    if n == 0:
        return "0 B"
    return ("+" if n > 0 else "-") + format_bytes(abs(n))


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s"


def _table(rows: list[list[str]], indent: str = "  ", gap: str = "  ",
           right: frozenset[int] = frozenset()) -> list[str]:
    """Columns padded to their widest cell, `gap` between them, trailing spaces stripped."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append((indent + gap.join(cells)).rstrip())
    return out


def format_rungs(ladder: LadderState) -> str:
    """'65536 [98304] 131072 ... 262144': the current rung in brackets, its neighbours, both ends;
    runs of two or more hidden rungs collapse to '...'."""
    rungs, cur = ladder.rungs, ladder.current
    n = len(rungs)
    if cur is not None and not 0 <= cur < n:
        cur = None
    keep = {0, n - 1} | ({cur - 1, cur, cur + 1} if cur is not None else {1})
    keep = {i for i in keep if 0 <= i < n}
    # a gap of exactly one rung is shown, since '...' would not be shorter
    for i in range(1, n - 1):
        if i not in keep and i - 1 in keep and i + 1 in keep:
            keep.add(i)
    parts, prev = [], -1
    for i in sorted(keep):
        if i > prev + 1:
            parts.append("...")
        parts.append(f"[{rungs[i]}]" if i == cur else str(rungs[i]))
        prev = i
    return " ".join(parts)


def format_ladder(ladder: LadderState) -> list[str]:
    """'ladder off', or 'ladder auto on: 65536 [98304] ... 262144 (step 32768)' and the last
    decision on an indented line."""
    if not ladder.enabled:
        return ["ladder off"]
    head = f"ladder auto {'on' if ladder.auto else 'off'}"
    head += f": {format_rungs(ladder)}" if ladder.rungs else " (no rungs)"
    if ladder.step:
        head += f" (step {ladder.step})"
    lines = [head]
    if ladder.last_decision:
        lines.append(f"  last: {_one_line(ladder.last_decision)}")
    return lines


def device_text(device: DeviceState) -> str:
    """The card by the driver's count, one line: in use, the allocator's peak, never taken, the headroom."""
    return (f"device: {format_bytes(device.used_bytes)} of {format_bytes(device.card_bytes)} in use (driver's count; "
            f"allocator peak {format_bytes(device.allocator_peak_bytes)}), {format_bytes(device.untouched_bytes)} never "
            "taken; "
            f"headroom {format_bytes(device.headroom_bytes)} kept back from the pools")


def format_cache(state: CacheState) -> str:
    """The `ft ctl cache` view:

    state=serving, 4.1 GiB allocated (rebuild budget 4.8 GiB)
      moe    512 slots (lru, 2.1%)   1.3 GiB    512..1843
      kv     262144 tok (4096 x 64)  1.9 GiB    64..648194
      mamba  8 slots                 882.3 MiB  4..44
      ladder off
    """
    head = f"state={state.state}, {format_bytes(state.allocated_bytes)} allocated"
    if state.budget_bytes:
        head += f" (rebuild budget {format_bytes(state.budget_bytes)})"
    moe, kv, mamba = state.pools.moe, state.pools.kv, state.pools.mamba
    if moe.total_experts:
        moe_size = f"{moe.size} slots ({moe.policy}, {100.0 * moe.size / moe.total_experts:.1f}%)"
    else:
        moe_size = f"{moe.size} slots ({moe.policy})"
    rows = [
        ["moe", moe_size, format_bytes(moe.bytes), format_range(moe.min, moe.max)],
        ["kv", f"{kv.size} tok ({kv.pages} x {kv.page_size})", format_bytes(kv.bytes), format_range(kv.min, kv.max)],
        ["mamba", f"{mamba.size} slots", format_bytes(mamba.bytes), format_range(mamba.min, mamba.max)],
    ]
    lines = [head, *_table(rows)]
    lines += ["  " + line for line in format_ladder(state.ladder)]
    if kv.dtype.startswith("float8"):  # (servers before this field sent none)
        lines.append(f"  kv cache {kv.dtype}: x / scale, one scale per layer for K and V")
    if moe.read_through:
        lines.append(f"  experts: decode reads misses from host memory in the step (read-through); "
                     f"{moe.landed} landed, {format_bytes(moe.host_bytes)} read from host")
    if moe.loan_bytes:
        lent = f"{format_bytes(moe.lent_bytes)} lent now" if moe.lent_bytes else \
            "recalled now (a long prompt's prefill)"
        lines.append(f"  experts: the prefill reserve lends them up to {format_bytes(moe.loan_bytes)} while prompts "
                     f"are short; {lent}")
    if mamba.on_demand_max:
        lines.append(f"  mamba: slots on demand, grown for waiting requests up to {mamba.on_demand_max} (expert slots "
                     f"give way) and given back when unused")
    if mamba.host_states:
        lines.append(f"  prefix cache: {mamba.host_states} cached prefixes keep their linear-attention state in host "
                     f"memory ({format_bytes(mamba.host_bytes)}), copied to a slot on a hit")
    if state.host_table_bytes:
        lines.append(f"  host: {host_tables_text(state.host_tables, state.host_table_bytes)} in host memory (rows "
                     "gathered per step; outside the budget, not traded by the ladder)")
    if state.disk_tables:
        lines.append(f"  disk: {host_tables_text(state.disk_tables, sum(state.disk_tables.values()))} read from the "
                     "checkpoint's files through the page cache (rows read by the host per step)")
    if state.host_memory.parts:  # (servers before this field sent none)
        hm = state.host_memory
        lines.append(f"  host memory: {host_plan_text(hm.parts, hm.available_bytes, hm.available_from)}")
    if state.device.card_bytes:  # a CUDA device (servers before this field sent none)
        lines.append("  " + device_text(state.device))
    ex = state.exchange
    if ex.kv_tokens_per_expert_slot:  # (servers before this field sent none)
        lines.append(f"  ranges: each with the other pools at their current sizes; 1 expert slot = "
                     f"{_rate(ex.kv_tokens_per_expert_slot)} kv tokens = {_rate(ex.mamba_slots_per_expert_slot)} mamba slots")
    if state.storage.reallocates:  # vmm and mmap free before they allocate: the seed's view as it is
        lines.append(f"  storage {state.storage.backend}: a resize copies, so old and new are held at once; "
                     "the ranges count it")
    for r in state.ranks:  # tensor parallelism: ranges above are the joint ones (every GPU reaches them)
        hits = f", {100.0 * r.hits / (r.hits + r.misses):.1f}% hits" if r.hits + r.misses else ""
        lines.append(f"  gpu {r.rank}: moe {r.moe_slots} slots{hits}, kv {r.kv_tokens} tok, mamba {r.mamba_slots} slots, "
                     f"{format_bytes(r.held_bytes)} held of {format_bytes(r.budget_bytes)} budget")
    if state.degraded:
        lines.append(f"  DEGRADED: {state.degraded}")
    return "\n".join(lines)


def _rate(x: float) -> str:
    """An exchange rate readable at a glance: 27, 0.13, 1.5."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def format_notes(notes: list[str]) -> list[str]:
    """'note: ...' lines (a KV size rounded to pages, ...)."""
    return [f"note: {n}" for n in notes]


def format_plan(plan: ResizePlan) -> str:
    """A dry run: the target, each step with its delta and the running total, the peak against
    the budget and whether it fits.

    dry run: moe 1024 kv 65536
      1.  shrink kv  -1.4 GiB  total 2.7 GiB
      2.  grow moe   +1.3 GiB  total 4.0 GiB
    peak 4.0 GiB of 4.8 GiB budget: fits
    """
    lines = [f"dry run: {format_geometry(plan.target)}"]
    totals = [format_bytes(s.total_bytes) for s in plan.steps]
    w = max(map(len, totals), default=0)
    rows = [[f"{i}.", s.action, format_signed_bytes(s.delta_bytes), f"total {t:>{w}}"]
            for i, (s, t) in enumerate(zip(plan.steps, totals), 1)]
    lines += _table(rows, right=frozenset({0, 2})) if rows else ["  (nothing to change)"]
    verdict = "fits" if plan.fits else "does not fit"
    tail = f"peak {format_bytes(plan.peak_bytes)} of {format_bytes(plan.budget_bytes)} budget: {verdict}"
    if plan.reason:
        tail += f" ({_one_line(plan.reason)})"
    lines.append(tail)
    lines += format_notes(plan.notes)
    return "\n".join(lines)


def format_time(unix_s: float) -> str:
    """Local wall-clock time HH:MM:SS (no date: the history covers one server's lifetime)."""
    return time.strftime("%H:%M:%S", time.localtime(unix_s)) if unix_s else "-"


def _history_row(e: HistoryEntry) -> list[str]:
    took = format_duration(e.phases.total_s) if e.status != "running" else "-"
    peak = format_bytes(e.peak_bytes) if e.peak_bytes else "-"
    return [str(e.id), format_time(e.time), e.trigger, format_change(e.from_, e.to), e.status, took, peak]


def format_history(history: History) -> str:
    """Rebuilds newest first, one row each; a ladder's reason and an error go on indented lines
    under their row.

     id  time      trigger  change                          status        took     peak
      2  22:18:20  manual   moe 512->1024 kv 262144->65536  rolled_back  2.3 s  4.6 GiB
           error: OutOfMemoryError('CUDA out of memory. Tried to allocate 800.00 MiB. ...')
      1  22:13:20  startup  moe 512 kv 262144 mamba 8       ok           9.1 s  4.1 GiB
    """
    if not history.entries:
        return "no rebuilds yet"
    entries = sorted(history.entries, key=lambda e: (e.id, e.time), reverse=True)  # ids count up
    header = ["id", "time", "trigger", "change", "status", "took", "peak"]
    table = _table([header] + [_history_row(e) for e in entries], indent=" ", right=frozenset({0, 5, 6}))
    id_width = max(len(str(e.id)) for e in entries)
    pad = " " * (1 + max(id_width, len("id")) + 2 + 2)  # under the time column, two further in
    lines = [table[0]]
    for e, row in zip(entries, table[1:]):
        lines.append(row)
        if e.reason:
            lines.append(f"{pad}reason: {_one_line(e.reason)}")
        if e.error:
            lines.append(f"{pad}error: {_one_line(e.error)}")
        if e.ranks:  # tensor parallelism: each GPU's measured peak
            peaks = ", ".join(f"gpu {r.rank} {format_bytes(r.peak_bytes) if r.peak_bytes else '-'}" for r in e.ranks)
            lines.append(f"{pad}peaks: {peaks}")
    return "\n".join(lines)


def format_requests(listing: RequestList) -> str:
    """The running requests, then the waiting ones, one row each, and a count line.

     id          state    prompt  generated  kv pages    age
     cmpl-3f2a…  decode      812         40        14  3.2 s
     cmpl-9b1c…  waiting     120          0         0  0.4 s
    2 running, 1 waiting
    """
    counts = f"{listing.running} running, {listing.waiting} waiting"
    if not listing.requests:
        return counts
    header = ["id", "state", "prompt", "generated", "kv pages", "age"]
    rows = [[r.id, r.state, str(r.prompt_tokens), str(r.generated_tokens), str(r.kv_pages), format_duration(r.age_s)]
            for r in listing.requests]
    lines = _table([header] + rows, indent=" ", right=frozenset({2, 3, 4, 5}))
    shown = f" (first {len(listing.requests)} shown)" if listing.truncated else ""
    return "\n".join([*lines, counts + shown])


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
