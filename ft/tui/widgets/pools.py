"""The pools panel: each pool's size, bytes, usage and reachable range, and the budget bar."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ft.ctl.format import POOL_ORDER
from ft.schemas import CacheState
from ft.tui.state import budget_segments, pool_cells, pool_usage, range_track, scale_bytes
from ft.units import format_bytes, host_tables_text

COLORS = {"moe": "#c678dd", "kv": "#56b6c2", "mamba": "#98c379", "free": "#5c6370"}
MIN_TRACK = 8


FILL = {"moe": "█", "kv": "▓", "mamba": "▒", "free": "░"}


def bar_text(state: CacheState, width: int) -> Text:
    """The budget bar: each pool's share in its colour and fill ('█' moe, '▓' kv, '▒' mamba),
    its name first when it fits, then the free slack ('░'); readable without colour too."""
    t = Text(no_wrap=True)
    for seg in budget_segments(state, width):
        if not seg.cells:
            continue
        label = seg.kind if len(seg.kind) + 1 <= seg.cells else ""
        style = f"bold {COLORS[seg.kind]}"
        if label:
            t.append(label + " ", f"bold reverse {COLORS[seg.kind]}" if seg.kind != "free" else style)
        t.append(FILL[seg.kind] * (seg.cells - len(label) - (1 if label else 0)), COLORS[seg.kind])
    return t


def track_text(state: CacheState, name: str, width: int) -> Text:
    """A pool's reachable range on the budget scale: '·' below its minimum, '█' what it holds
    above that, '━' the room it could grow into, then the rest of the budget blank."""
    tr = range_track(state, name, width)
    color = COLORS[name]
    t = Text(no_wrap=True)
    t.append("·" * tr.lo, "#5c6370")
    t.append("█" * (tr.cur - tr.lo), color)
    t.append("━" * (tr.hi - tr.cur), color)
    t.append(" " * (width - tr.hi))
    return t


class PoolsPanel(Widget):
    """Renders to its width: a summary line, the budget bar, one row per pool."""

    cache: reactive[CacheState | None] = reactive(None, layout=True)

    def render(self) -> Group:
        c = self.cache or CacheState()
        width = max(10, self.size.width)
        free = max(0, c.budget_bytes - c.allocated_bytes)
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"budget {format_bytes(scale_bytes(c) if c.budget_bytes else 0)}  ")
        head.append(f"allocated {format_bytes(c.allocated_bytes)}  ")
        head.append(f"free {format_bytes(free)}", COLORS["free"] if not free else "")
        if c.context_limit:
            head.append(f"  context {c.context_limit} tok")
        if c.storage.reallocates:  # vmm / mmap free before they allocate; this one does not
            head.append(f"  storage {c.storage.backend}: ranges count old + new", "bold yellow")
        if c.host_table_bytes:  # (the n-gram table, the embedding: host memory, outside the budget)
            head.append(f"  host {host_tables_text(c.host_tables, c.host_table_bytes)}", "dim")
        if c.disk_tables:  # (--ngram-table disk: read through the page cache)
            head.append(f"  disk {host_tables_text(c.disk_tables, sum(c.disk_tables.values()))}", "dim")
        if c.host_memory.parts:  # (what the server pins in host memory, against what the host had before loading)
            have = c.host_memory.available_bytes
            head.append(f"  host memory {format_bytes(sum(c.host_memory.parts.values()))}"
                        + (f" of {format_bytes(have)}" if have is not None else ""), "dim")
        cells, usage = pool_cells(c), pool_usage(c)
        rows = [[name, *cells[name][:2], cells[name][2], usage[name]] for name in POOL_ORDER]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        text_w = sum(widths) + 2 * len(widths)
        track_w = width - text_w
        lines = [head, bar_text(c, width)]
        d = c.device
        if d.card_bytes:  # a CUDA device: the card by the driver's count, beside the planned budget
            card = Text(no_wrap=True, overflow="ellipsis", style="dim")
            card.append(f"card {format_bytes(d.used_bytes)}/{format_bytes(d.card_bytes)} used (driver), "
                        f"{format_bytes(d.untouched_bytes)} untouched, headroom "
                        f"{format_bytes(d.headroom_bytes)}")
            lines.append(card)
        ex = c.exchange
        if ex.kv_tokens_per_expert_slot:  # how the ranges read, and what a slot trades for
            note = Text(no_wrap=True, overflow="ellipsis", style="dim")
            note.append(f"ranges hold the other pools where they are; 1 expert slot = "
                        f"{ex.kv_tokens_per_expert_slot:.0f} kv tok = {ex.mamba_slots_per_expert_slot:.2g} mamba slots")
            lines.append(note)
        for r in rows:
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append(r[0].ljust(widths[0]) + "  ", f"bold {COLORS[r[0]]}")
            t.append(r[1].ljust(widths[1]) + "  ")
            t.append(r[2].rjust(widths[2]) + "  ")
            t.append(r[3].rjust(widths[3]) + "  ", "dim")
            t.append(r[4].ljust(widths[4]) + "  ")
            if track_w >= MIN_TRACK:
                t.append_text(track_text(c, r[0], track_w))
            lines.append(t)
        for r in c.ranks:  # tensor parallelism: every GPU's own pools (the ranges above are joint)
            t = Text(no_wrap=True, overflow="ellipsis", style="dim")
            hits = f" ({100.0 * r.hits / (r.hits + r.misses):.0f}% hits)" if r.hits + r.misses else ""
            t.append(f"gpu {r.rank}: moe {r.moe_slots} slots{hits}  kv {r.kv_tokens} tok  mamba {r.mamba_slots}  "
                     f"{format_bytes(r.held_bytes)} of {format_bytes(r.budget_bytes)}")
            lines.append(t)
        return Group(*lines)
