"""The pools and what backs them: `kv_pool` (paged KV), `mamba_pool` (linear-attention state
slots), `expert_cache` (expert slots over a host store), `cache_pools` (the three together),
`storage` (vmm / mmap / realloc backends: `vmm`, `host_reservation`), `resizable` (tail resizes,
all-or-nothing across a pool's tensors). Imports `ft.kernels` only."""
