"""Progress while a rebuild runs: one we asked for, or the server reports state "rebuilding"."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar


class RebuildProgress(Horizontal):
    """Hidden when idle; `start(what)` shows an indeterminate bar labelled `what`."""

    def compose(self) -> ComposeResult:
        yield Label("", id="rebuild-label")
        yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="rebuild-bar")

    def start(self, what: str) -> None:
        self.query_one("#rebuild-label", Label).update(f"rebuilding: {what}")
        self.add_class("-shown")

    def stop(self) -> None:
        self.remove_class("-shown")
