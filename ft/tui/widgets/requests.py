"""The request list: the server's running requests, then its waiting ones (GET /admin/requests), one
row each: id, state, prompt and generated tokens, KV pages held, age. The selected row stays
selected across updates while its request is there."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from ft.schemas import RequestList
from ft.tui.state import format_age

COLUMNS = (("id", "id"), ("state", "state"), ("prompt", "prompt tok"), ("generated", "generated"),
           ("kv_pages", "kv pages"), ("age", "age"))
STATE_STYLE = {"decode": "green", "prefill": "bold cyan", "waiting": "yellow"}


def summary(requests: RequestList) -> str:
    """'3 running · 1 waiting', and how many are not listed when the list is cut."""
    text = f"{requests.running} running · {requests.waiting} waiting"
    hidden = requests.running + requests.waiting - len(requests.requests)
    if requests.truncated and hidden > 0:
        text += f" ({hidden} not listed)"
    return text


class RequestsPanel(Vertical):
    """`set_requests(list)` redraws the table; `set_message(text)` says why there is none."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.shown: RequestList | None = None

    def compose(self) -> ComposeResult:
        table = DataTable(id="requests-table", cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Static("waiting for the server", id="requests-note", classes="-shown", markup=False)

    def set_requests(self, requests: RequestList) -> None:
        self.shown = requests
        table = self.query_one("#requests-table", DataTable)
        selected = None
        if table.row_count and 0 <= table.cursor_row < table.row_count:
            selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        table.clear()
        seen: set[str] = set()
        for r in requests.requests:
            if r.id in seen:  # a row key must be unique
                continue
            seen.add(r.id)
            table.add_row(r.id, Text(r.state, STATE_STYLE.get(r.state, "")),
                          Text(str(r.prompt_tokens), justify="right"), Text(str(r.generated_tokens), justify="right"),
                          Text(str(r.kv_pages), justify="right"), Text(format_age(r.age_s), justify="right"), key=r.id)
        if selected in seen:
            table.move_cursor(row=table.get_row_index(selected))
        self.border_subtitle = summary(requests)
        note = self.query_one("#requests-note", Static)
        note.update("" if requests.requests else "no requests running or waiting")
        note.set_class(not requests.requests, "-shown")

    def set_message(self, message: str) -> None:
        note = self.query_one("#requests-note", Static)
        note.update(message)
        note.set_class(True, "-shown")

    def focus_table(self) -> None:
        self.query_one("#requests-table", DataTable).focus()
