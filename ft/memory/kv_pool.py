"""Paged KV cache of the full-attention layers.

One tensor `kv` [P, L, 2, page_size, Hkv, R] (P pages, L full-attention layers, K and V, R
elements per token and kv head: R = D, the head dim, except for NVFP4): pages are outermost so
that the pool can grow or shrink at its tail. Pages are reference counted so that prefix-cache
entries and running requests can share them.

A quantized pool stores x / scale with one scale per layer for K and one for V (`scales` [L, 2]
float32 on the device, 1.0 until a checkpoint provides its own); the attention kernels quantize
on write and dequantize on read (`ft.kernels.attention`, whose `reference.py` states the exact
rounding). Quantized dtypes:

* float8_e4m3fn: R = D, one e4m3 per element (x / scale, clamped to +-448).
* NVFP4 (asked for with `NVFP4_KV`, i.e. torch.uint8): R = D/2 + D/16 bytes (D % 16 == 0), one
  row per token and kv head: bytes [0, D/2) hold the E2M1 codes of x / (block scale * scale),
  two per byte (element 2j in the low nibble of byte j, as the NVFP4 weights), and bytes
  [D/2, D/2 + D/16) the float8_e4m3fn block scales (bits), one per 16 consecutive elements of D.
  Head dim 256: 128 + 16 = 144 bytes per token, head and K or V, against bf16's 512 (the
  flagship, 12 layers x 2 kv heads: 6,912 bytes per token against 24,576). Values and scales
  of a token sit together so that the pool stays one tensor whose bytes per page follow from
  its shape (what `ft.memory.layout` measures), and pages copy, relocate and resize as
  plain rows, on every storage backend.

A model with QSA attention (Qwen3.8-Flash-Next) also keeps each token's raw indexer key beside its
K and V: `index_keys` [P, L, page_size, Di] in the compute dtype (`index_key_dim` Di; None without
QSA), paged, copied and resized with `kv`. Raw keys, not the compressed blocks: a block's key is the
mean of its tokens' raw keys, so the tokens of an incomplete block must stay; compressing at read
costs a pass over them (the torch path; the Triton path will keep compressed blocks, 4x fewer bytes).
"""

from __future__ import annotations

from collections import deque

import torch

from ft.memory.resizable import PoolInconsistent, narrow_to_common, resize_together
from ft.memory.storage import PoolStorage

NVFP4_KV = torch.uint8
"""The dtype that asks `KVPool` for an NVFP4 pool (and the dtype of its tensor): a uint8 cache is
NVFP4 everywhere (`ft.kernels.attention`)."""

QUANTIZED_KV = (torch.float8_e4m3fn, NVFP4_KV)
"""KV dtypes stored as x / scale (per layer, K and V)."""


def kv_row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` per token and kv head: D, or D/2 + D/16 bytes for NVFP4.

    Raises: ValueError for NVFP4 with a head dim that is not a multiple of 16."""
    if dtype != NVFP4_KV:
        return head_dim
    if head_dim % 16:
        raise ValueError(f"an NVFP4 KV cache needs a head dim multiple of 16, got {head_dim}")
    return head_dim // 2 + head_dim // 16


class KVPool:
    """Pages of KV plus their allocator. Sizes are in tokens for users, pages inside."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        storage: PoolStorage | None = None,
        index_key_dim: int = 0,
        index_dtype: torch.dtype | None = None,
    ) -> None:
        self.page_size = page_size
        self.head_dim = head_dim
        self.storage = storage or PoolStorage(device)
        row = kv_row_size(head_dim, dtype)
        self.kv = self.storage.zeros(num_pages, (num_layers, 2, page_size, num_kv_heads, row), dtype)
        self.index_keys = self.storage.zeros(num_pages, (num_layers, page_size, index_key_dim), index_dtype or dtype) \
            if index_key_dim else None
        # NOTE: not a pool tensor (no per-page rows): fixed size, never resized, stable address
        self.scales = torch.ones((num_layers, 2), dtype=torch.float32, device=device) \
            if dtype in QUANTIZED_KV else None
        # the next prefill sets `scales` from its K and V (the engine asks for it when no checkpoint
        # gave scales; `ft.model.forward_batch.ForwardBatch.calibrate_kv`)
        self.calibrate_next_prefill = False
        self.journal = None  # a `ft.engine.base.step_inputs.PoolJournal` recording content copies (tensor parallelism)
        self._refs = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    # --------------------------------------------------------------------------- geometry
    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype_name(self) -> str:
        """The cache's format for people: "nvfp4", else the torch dtype's name ("bfloat16", "float8_e4m3fn")."""
        return "nvfp4" if self.kv.dtype == NVFP4_KV else str(self.kv.dtype).removeprefix("torch.")

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The pool's tensors, each [P, ...] (what its bytes are made of)."""
        return [self.kv] if self.index_keys is None else [self.kv, self.index_keys]

    @property
    def bytes_per_page(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(k_cache, v_cache, kv_scale) of full-attention layer i: views [P, page_size, Hkv, R] (R = D,
        or D/2 + D/16 uint8 for NVFP4, see the module docstring) and, for a quantized pool, its (K, V)
        scales float32 [2] (None otherwise)."""
        return self.kv[:, i, 0], self.kv[:, i, 1], None if self.scales is None else self.scales[i]

    def index_layer(self, i: int) -> torch.Tensor | None:
        """Full-attention layer i's raw indexer keys [P, page_size, Di] (None without QSA)."""
        return None if self.index_keys is None else self.index_keys[:, i]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --------------------------------------------------------------------------- allocation
    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with one reference each. Call `can_allocate` first."""
        if n > len(self._free):
            raise MemoryError(f"KV pool: {n} pages asked, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def ref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} is free"
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference of each page; pages with none left return to the free list."""
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released twice"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def copy_page(self, src: int, dst: int) -> None:
        for t in self.tensors:
            t[dst].copy_(t[src])
        if self.journal is not None:
            self.journal.ops.append(("kv_copy", src, dst))

    # --------------------------------------------------------------------------- resizing
    def pages_in_use_from(self, n: int) -> list[int]:
        """Pages with an index >= n that something still references."""
        return [p for p in range(n, self.num_pages) if self._refs[p] > 0]

    def relocate_above(self, n: int) -> dict[int, int]:
        """Copy every used page >= n into a free page < n; returns {old: new}. The caller rewrites
        the page lists that held the old ids. Needs num_used_pages <= n."""
        moving = self.pages_in_use_from(n)
        low_free = [p for p in self._free if p < n]
        if len(low_free) < len(moving):
            raise MemoryError(f"KV pool: {len(moving)} pages to keep above {n}, {len(low_free)} free below")
        moves = dict(zip(moving, low_free))
        taken = set(moves.values())
        self._free = deque(p for p in self._free if p not in taken)
        for old, new in moves.items():
            for t in self.tensors:
                t[new].copy_(t[old])
            if self.journal is not None:
                self.journal.ops.append(("kv_copy", old, new))
            self._refs[new], self._refs[old] = self._refs[old], 0
            self._free.append(old)
        return moves

    def resize(self, num_pages: int) -> None:
        """Grow or shrink to `num_pages`; pages >= num_pages must be free when shrinking. All or
        nothing: on an error the pool keeps its old size (the allocator state follows the tensor)."""
        if self.pages_in_use_from(num_pages):
            raise RuntimeError(f"KV pool: pages >= {num_pages} are still in use")
        old = self.num_pages
        ts = self.tensors
        try:
            resize_together(self.storage, ts, num_pages, "kv")
        except PoolInconsistent:
            ts = narrow_to_common(ts)
            raise
        finally:
            self.kv = ts[0]
            self.index_keys = ts[1] if len(ts) > 1 else None
            self._follow(old)

    def _follow(self, old: int) -> None:
        """Bring the free list and reference counts from `old` pages to the tensor's page count."""
        n = self.num_pages
        if n < old:
            self._free = deque(p for p in self._free if p < n)
            del self._refs[n:]
        elif n > old:
            self._free.extend(range(old, n))
            self._refs.extend([0] * (n - old))
