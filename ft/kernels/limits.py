"""The kernels' shape limits as plain numbers (no torch, no triton), for the checks that run before a
model loads (`ft.model.kernel_support`, called by `ft serve`'s preflight, which imports no torch).

Each is the value of the constant or literal named beside it, which stays the kernels' own;
tests/test_kernel_support.py checks that the two agree.
"""

from __future__ import annotations

GATED_DELTA_MAX_DK = 256
"""`gated_delta.chunk_kernel.MAX_DK` (prefill: key and value head dims) and `gated_delta.kernel.MAX_DK`
(decode: the key head dim); past it the dispatchers run the torch references."""

ATTENTION_MAX_HEAD_DIM = 256
"""`attention.kernel.MAX_HEAD_DIM`: the decode and prefill attention kernels raise past it (no fallback)."""

NORM_MAX_D = 8192
"""`norm.kernel.MAX_D`: the norm dispatchers run the references past it; `moe.decode_kernel`'s fused next
norm calls the kernel itself (`add_rms_norm_triton`), which raises past it."""

ROUTER_MAX_EXPERTS = 8192
"""The router dispatchers' literal (`router.router_topk`, `router.route`): past it, the references."""

NVFP4_BLOCK = 16
"""`nvfp4.reference.BLOCK_SIZE`: values per E4M3 block scale; a weight's K (and an NVFP4 KV cache's head
dim) is a multiple of it."""

WHOLE_K_MAX_WORDS = 1024
"""`nvfp4.kernel.whole_k_words`: a row of K / 8 words is one tile when K / 8 is a power of two up to
this (`whole_k_pieces`: or two tiles, this and a smaller power of two);
`moe.decode_kernel.moe_decode_triton` with the host store (read-through) raises otherwise."""


def whole_k_pieces(k: int) -> tuple[int, int]:
    """A row's K / 8 words as at most two whole-K tiles, (first, second) words, each a power of two
    (the first <= WHOLE_K_MAX_WORDS, the second >= 2 or 0: one tile): K / 8 = 2^a or 2^a + 2^b.
    (0, 0) for any other K. The decode MoE takes K this way (Qwen3.8-Flash-Next's hidden 2,560 is
    256 + 64 words, its expert width 640 is 64 + 16); `ft.model.kernel_support` checks with it."""
    kw = k // 8
    if k % 16 or kw <= 0:
        return 0, 0
    first = 1 << (kw.bit_length() - 1)
    second = kw - first
    if first > WHOLE_K_MAX_WORDS or (second and (second < 2 or second & (second - 1))):
        return 0, 0
    return first, second

CONV_MIN_WIDTH = 2
"""`conv1d.kernel.causal_conv1d_varlen_triton` and `gated_delta.kernel` take conv weights [C, W >= 2]
(the rolling state holds W - 1 inputs)."""

PREFILL_MAX_TILE = 128 * 256
"""Rows x columns of `attention.prefill_kernel`'s query tile (rows: the next power of two of the GQA
group, at least 128 (`prefill_config`); columns: the next power of two of the head dim, at least 16)
known to fit the H200's shared memory in bf16: 128 x 256 and 256 x 128 ran; 256 x 256 asked for
262,176 bytes of the 232,448 there are (Triton OutOfResources at launch, 2026-12-02)."""
