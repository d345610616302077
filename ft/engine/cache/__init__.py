"""The cache manager and its parts: `layout` (the one byte arithmetic), `budget` (what the pools may
use, the startup geometry), `planner` (plans and reachable ranges), `rebuild` (the executor),
`manager` (the composition the engine holds)."""
