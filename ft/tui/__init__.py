"""`ft top`: the Textual dashboard (never imports torch)."""
