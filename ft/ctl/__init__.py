"""`ft ctl`: the scriptable admin client (httpx only; never imports torch)."""
