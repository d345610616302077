"""The cache manager: `manager` (the composition the engine holds: pools, limits and ranges, plans,
history), `rebuild` (the executor of a live resize), `tp_rebuild` (its two-phase form over
tensor-parallel ranks), `log_line`. Its arithmetic has no engine in it and lives in `ft.memory`:
`layout` (the one byte arithmetic), `budget` (what the pools may use, the startup geometry),
`planner` (plans and reachable ranges)."""
