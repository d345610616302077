"""The connection banner: shown while the server cannot be reached (or refuses the token)."""

from __future__ import annotations

from textual.widgets import Static


class ConnectionBanner(Static):
    """Hidden while connected; `show(message, retry_in)` fills and shows it."""

    def show(self, message: str, retry_in: float) -> None:
        retry = f" (retrying in {retry_in:g} s)" if retry_in else ""
        self.update(f"{message}{retry}")
        self.add_class("-shown")

    def hide(self) -> None:
        self.remove_class("-shown")
