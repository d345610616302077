"""The pools and what backs them: `kv_pool` (paged KV), `mamba_pool` (linear-attention state
slots), `expert_cache` (expert slots over a host store), `cache_pools` (the three together),
`storage` (vmm / mmap / realloc backends: `vmm`, `host_reservation`), `resizable` (tail resizes,
all-or-nothing across a pool's tensors); and the cache manager's arithmetic (`ft.engine.cache` holds
the manager): `layout` (bytes per unit of each pool), `budget` (what the pools may use, the startup
geometry), `planner` (resize plans, reachable ranges). Imports `ft.kernels` only."""
