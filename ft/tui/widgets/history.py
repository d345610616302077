"""Rebuild history: a table (time, trigger, from -> to, status, duration, peak), newest first, and
the selected row's details (phases, reason, error) below it. The selection follows the newest entry
until the user moves it to another row; a row picked stays picked as new entries arrive."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from ft.ctl.format import format_change, format_duration, format_time
from ft.schemas import History, HistoryEntry
from ft.units import format_bytes

COLUMNS = (("time", 8), ("trigger", 7), ("from -> to", 34), ("status", 11), ("took", 7), ("peak", 9))
STATUS_STYLE = {"ok": "green", "rolled_back": "bold red", "refused": "yellow", "running": "bold yellow"}


def details_text(e: HistoryEntry) -> str:
    """The phases of one rebuild, its measured peak, reason and error, as Rich markup-free text."""
    p = e.phases
    parts = [f"#{e.id} {e.trigger} {e.status}: quiesce {p.quiesce_s:.2f} s  free {p.free_s:.2f} s  "
             f"allocate {p.allocate_s:.2f} s  fill {p.fill_s:.2f} s  graphs {p.graphs_s:.2f} s  "
             f"total {p.total_s:.2f} s"]
    if e.measured_peak_bytes:
        parts.append(f"measured peak {format_bytes(e.measured_peak_bytes)}")
    if e.reason:
        parts.append(f"reason: {' '.join(e.reason.split())}")
    if e.error:
        parts.append(f"error: {' '.join(e.error.split())}")
    return "\n".join(parts)


class HistoryPanel(Vertical):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._entries: dict[str, HistoryEntry] = {}
        self._shown: list | None = None

    def compose(self) -> ComposeResult:
        table = DataTable(id="history-table", cursor_type="row", zebra_stripes=True)
        for name, width in COLUMNS:
            table.add_column(name, width=width, key=name)
        yield table
        yield Static("", id="history-details", markup=False)

    def set_history(self, history: History) -> None:
        entries = sorted(history.entries, key=lambda e: (e.id, e.time), reverse=True)
        key = [e.model_dump() for e in entries]
        if key == self._shown:
            return
        self._shown = key
        table = self.query_one("#history-table", DataTable)
        selected, follow = None, True  # (on the newest row, the selection follows the newest entry)
        if table.row_count and 0 <= table.cursor_row < table.row_count:
            selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            follow = table.cursor_row == 0
        table.clear()
        self._entries = {}
        for e in entries:
            k = str(e.id)
            self._entries[k] = e
            took = format_duration(e.phases.total_s) if e.status != "running" else "..."
            peak = format_bytes(e.peak_bytes) if e.peak_bytes else "-"
            table.add_row(format_time(e.time), e.trigger, format_change(e.from_, e.to),
                          Text(e.status, STATUS_STYLE.get(e.status, "")), Text(took, justify="right"),
                          Text(peak, justify="right"), key=k)
        if selected in self._entries and not follow:  # a row the user picked stays picked
            table.move_cursor(row=table.get_row_index(selected))
        elif table.row_count:
            table.move_cursor(row=0)
        self._show_details()

    def _show_details(self) -> None:
        table = self.query_one("#history-table", DataTable)
        details = self.query_one("#history-details", Static)
        if not table.row_count:
            details.update("no rebuilds yet")
            return
        k = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        e = self._entries.get(k)
        details.update(details_text(e) if e else "")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._show_details()

    def focus_table(self) -> None:
        self.query_one("#history-table", DataTable).focus()
