"""The connection banner: shown while the server cannot be reached (or refuses the token)."""

from __future__ import annotations

from textual.widgets import Static

from ft.tui.state import format_age


class ConnectionBanner(Static):
    """Hidden while connected; `show(message, retry_in)` fills and shows it."""

    def show(self, message: str, retry_in: float) -> None:
        retry = f" (next try in {format_age(retry_in)}; R tries now)" if retry_in else " (R tries again)"
        self.update(f"{message}{retry}")
        self.add_class("-shown")

    def hide(self) -> None:
        self.remove_class("-shown")
