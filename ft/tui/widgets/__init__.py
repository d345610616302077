"""The widgets of `ft top`, one per file, grouped by screen area."""
