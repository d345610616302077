"""Kernel options as data: one frozen options object per operation, the chosen defaults in one place,
variants selected by name.

The dispatchers read `kernel_options()` when they launch (a few attribute reads; a CUDA graph holds
what was read at capture). Nothing overwrites a module global to pick a path: a benchmark or test
builds the options it wants (`variant("nvfp4-lanes-triton")`, or `dataclasses.replace`) and runs
inside `use_kernel_options(...)`, which puts the previous options back on exit. A variant stays
only with a measured reason (bench/RESULTS.md); one that loses its measurement is deleted here and
in its kernel, its figures kept in RESULTS.md.

Operations covered so far: the NVFP4 GEMV / tile decode (`Nvfp4Options`), the dense skinny GEMM's reach
(`DenseOptions`), the Triton MoE's grouped
prefill (`MoeOptions`), Gated DeltaNet's chunked prefill (`GatedDeltaOptions`), prefill attention's
paths on CUDA (`PrefillAttentionOptions`), the paged decode attention's launch choices
(`DecodeAttentionOptions`), the HyperConnection read (`HyperConnectionOptions`), QSA's prefill
selection (`QsaOptions`) and programmatic dependent launch (`LaunchOptions`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Conv1dOptions", "DecodeAttentionOptions", "DenseOptions", "GatedDeltaOptions", "HyperConnectionOptions",
           "KernelOptions", "LaunchOptions", "MoeOptions", "Nvfp4Options",
           "PrefillAttentionOptions", "QsaOptions", "VARIANTS", "kernel_options", "model_defaults", "set_kernel_options",
           "use_kernel_options", "variant"]


@dataclass(frozen=True)
class Nvfp4Options:
    """The NVFP4 weight decode in the GEMV and tile kernels (`ft.kernels.nvfp4`, the decode MoE).

    small_m_whole_k: the whole-K GEMV at M = 3..8 on the shapes where it beat the 16-row tile
    (out_proj, the experts' gate_up); off: those take the tile too.
    dot_halves: the small-M ``tl.dot`` tiles (M <= 64, bf16 or fp16 x) take x's even and odd
    columns against the weight's low and high nibbles, each decoded straight to x's dtype by byte
    permutes in inline PTX: two dots per K step, no interleave (sm_90 SASS, M = 8, 32 x 256 tile:
    561 instructions a K step against 799 for the interleaved byte-wise decode).
    lanes_ptx: the whole-K tiles (the M <= 8 GEMV, the decode MoE kernels) decode a word's 8
    elements to fp32 in inline PTX on a CUDA device (the same values as the Triton form, fewer
    instructions); off: the Triton form.
    The fp16 block sums: the decode MoE's per-pair whole-K tiles (one x row each) sum each block's 16
    products in an fp16 pair (`rows.dot_words_half`: four `fma.rn.f16x2` a word of 8 elements where the
    fp32 form converts and multiplies each element; sm_90 SASS of the gate/up kernel, one token at the
    80B's shape: 728 -> 640 instructions, 78 -> 55 registers; the others in bench/RESULTS.md session 42),
    for bf16 / fp16 models; x rounded to fp16 (a bf16 x's products exact), a block's sums rounded in fp16
    (~2**-11 of it), an x row with |x| >= 32,768 scaled by a power of two and back (one reduction a
    program). half_sums: those kernels at two tokens or more, **on** (H200, session 44, `bench/decode.py
    --replay-span 50`, MoE and GEMV together against the defaults then: the 80B's step at batch 8 / 32 / 64
    6.13 -> 5.52, 15.25 -> 13.05, 26.59 -> 22.75 ms, +11% / +17% / +17% tok/s, two rounds alike;
    Flash-Next's (48 layers) at batch 8 11.59 -> 10.62 ms, +9%; the block alone 1.16-1.17x at batch 8-64,
    error against the reference 1.6e-3, `bench/moe_decode.py`; variant "nvfp4-no-half-sums" turns them
    off). At one token, and in the M = 1 GEMV, they lost and were deleted (session 46, H100, Flash-Next 40
    layers at batch 1, replay 3.699 / 3.704 ms with neither against 3.752 with the MoE's at one token and
    3.716 with the GEMV's; session 44 had the 80B +0.6% with both): those kernels keep the fp32 sums.
    (The K loop at M = 1 where K / 8 is the sum of two powers of two lost to two whole-K tiles: session 40,
    H200, Flash-Next's step at batch 1, GPU busy 4.83 -> 4.59 ms; its option `gemv_two_tiles` deleted, the
    two tiles always taken there; RESULTS.md sessions 39-40.)
    dot_split_k: the ``tl.dot`` tile at 16 < M <= 64 (the 80B's decode at batch 17-64) splits K over this
    many programs a tile, fp32 partials to a workspace and the tile's last program (an atomic ticket) sums
    them in split order and stores y (the split-K ticket in `ft.kernels.nvfp4.kernel`): more programs where
    the tile grid is one thin wave (in_proj_qkvz at M = 32: 192 programs on 132 SMs, 16 K steps each;
    0.66 TB/s, session 28), at the cost of the partials' bytes through L2. 1 (off) on every mid-M shape: in the 80B's step (H200,
    session 44, `bench/decode.py --replay-span 50`) 2 splits everywhere took batch 32 15.25 -> 15.07 ms and
    batch 64 26.59 -> 26.60, 4 splits 15.16 / 27.08 (variants "nvfp4-dot-split-k-2", "nvfp4-dot-split-k-4").
    dot_split_k_few_tiles: the splits where the mid-M tile grid has too few programs and K is long
    (`kernel.MID_M_MIN_PROGRAMS`, `SPLIT_K_MIN_K`: out_proj / o_proj), instead of the narrower tile: 4, from the
    kernel sweep (12.46 -> 9.84 us at M = 32, 17.23 -> 11.50 at 64, `bench/kernels_nvfp4.py --sweep --decode-m
    32,64`); 1: the narrow tile (variant "nvfp4-dot-no-split-k").
    dot_split_k_small_m: the same rule for the 16-row tile (3 <= M <= 16 on the tile path: batch 3-16 decode):
    where its grid has fewer than `kernel.MID_M_MIN_PROGRAMS` programs and K >= `SPLIT_K_MIN_K` (out_proj
    2,048 x 4,096: 64 programs of 16 K steps; Flash-Next's out_proj / o_proj 2,560 x 6,144: 80 of 24), K over
    this many programs: **4** (H200, session 45, Flash-Next 48 layers, batch 8, `bench/decode.py --replay-span
    50`: 10.568 / 10.590 ms a replay with the whole K against 10.348 split in 4, 761.4 / 762.5 -> 779.2 tok/s,
    +2.2%; the 80B's batch 3-16, whose out_proj takes it too, not yet measured); 1: the whole K (variant
    "nvfp4-dot-no-split-k-small-m"; "nvfp4-dot-split-k-small-m-2" splits in 2).
    dot_small_m_past_wave_warps: the 16-row tile's warps where its grid (K whole) holds more programs than one
    wave of 4-warp programs (`kernel.SMALL_M_WAVE_PROGRAMS_PER_SM` an SM, whose note has the measurements):
    2; 4 keeps the tile as elsewhere (variant "nvfp4-dot-small-m-4-warps").
    dot_f16_x_max_m: a bf16 x of at most this many rows on the tiles' halves form is first made fp16 rows, each
    scaled by a power of two (`f16_rows`: one small launch; exact but for elements under 2**-28 of their row's
    largest), so that the weights decode as E4M3 bytes two to a conversion (`e2m1_halves_f16_scaled`) and feed
    fp16 MMAs, instead of bf16 byte permutes; y is still bf16. None, the default: the model's choice
    (`model_defaults`, a model's `kernel_defaults`; 0 where it names none): 64 for Qwen3.8-Flash-Next (the 16-row
    and the mid-M tiles); the 80B names none: with 16 its step was 0.5 / 0.5 / 0.8% slower at batch 8 / 16 / 32
    (H100, session 50, `bench/decode.py --modes overlap,overlap:V,overlap --replay-span 50`, against the mean of
    the defaults' two rounds, which drifted 3% apart: 1,345.1 -> 1,338.9, 1,925.1 -> 1,914.7, 2,380.1 -> 2,362.1
    tok/s), no gain; its variant "nvfp4-dot-f16-x" was deleted. A choice by model, not by launch: eager steps
    and graph replays of one model compute the same bits. sm_90 SASS of the K step (session 49): the 16-row
    tile 561 -> 336 instructions (PRMT 160 -> 80, LOP3 131 -> 35), its 2-warp form at Flash-Next's in_proj_qkvz
    990 -> 547, the mid-M tiles 565 -> 348 (32 rows) and 655 -> 435 (64); the tile was issue-bound (ncu,
    session 48: ALU 62.6%, DRAM 27%).
    Flash-Next's step (H100, 40 layers, `bench/decode.py --replay-span 50`, one process): at 16 rows, session
    49, batch 8 910.7 / 908.6 -> 942.8 / 937.7 tok/s (+3.3%), with the two-tile down tile
    (`MoeOptions.decode_down_two_tiles`) 909.8 -> 959.0 (+5.4%); at 64 rows against 16, session 50, batch 32
    1,498.5 / 1,500.2 -> 1,531.5 (+2.1%), batch 48 1,641.8 / 1,639.0 -> 1,644.9 (a tie). Variant
    "nvfp4-dot-bf16-x" (0: off).
    (Wider tiles at 3-64 rows, 64 and 128 columns by option, which read less x per weight byte, lost 1.5-4% of
    both models' steps on the H100 in session 62; the options were deleted, commit c1910ec holds them. The
    fp16 tile's scales made fp16 before they spread, and L2 prefetch hints for its weight rows, lost Flash-Next's
    batch-8 step on the H200, -1.8% / -3.3%, in session 64; commit 7a1b5a7 holds them.)"""

    small_m_whole_k: bool = True
    dot_halves: bool = True
    lanes_ptx: bool = True
    half_sums: bool = True
    dot_split_k: int = 1
    dot_split_k_few_tiles: int = 4
    dot_split_k_small_m: int = 4
    dot_small_m_past_wave_warps: int = 2
    dot_f16_x_max_m: int | None = None


@dataclass(frozen=True)
class DenseOptions:
    """The dense skinny GEMM of the decode step's small bf16 projections (`ft.kernels.dense`: the router with the
    shared expert's gate, 513 x 2,048 on the 80B; in_proj_ba).

    max_m: rows of x up to which the dispatcher runs the Triton kernel (F.linear, cuBLAS, above). 16 since the
    kernel came (2026-11-30, bench/dense_gemv.py at 1 and 8 rows: the router with the shared gate 3.78 us against
    cuBLAS's 10.48 at 8). Past 16 rows cuBLAS takes a split-K GEMM and its reduce for the router (the 80B's batch-64
    step, H100, session 62: 9.3 + 2.1 us a layer, 0.55 ms of 22.6). The kernel there, alone (H100, us, kernel /
    cuBLAS): the 80B's router 513 x 2,048 at 32 rows 5.93 / 10.26, at 64 9.65 / 11.51; Flash-Next's 513 x 2,560 at
    32 10.60 / 13.10, at 64 16.22 / 14.65. In the 80B's step with 64 (bench/decode.py --replay-span 40, two rounds,
    ms a replay): batch 32 13.210 / 13.209 against 13.214 / 13.462, batch 64 23.002 / 22.975 against 22.794 / 22.864:
    inside the rounds' spread at 32, a loss at 64, so the bound stays (its variant deleted; `--define
    r='{"dense.max_m": 32}'` makes one)."""

    max_m: int = 16


@dataclass(frozen=True)
class MoeOptions:
    """The Triton MoE's grouped (prefill) path and its decode path's padding rows (`ft.kernels.moe`).

    grouped_words: decode the weight tiles a 32-bit word of codes at a time in fp16 where the pool's
    rows allow (sm_90 SASS: the gate_up loop 802 -> 520 instructions a step, down 833 -> 554; H200,
    bench/moe_prefill.py --words, one layer of 512 experts, top-10: 1,024 tokens 1.131 -> 0.868 ms,
    4,096 tokens 1.959 -> 1.790 ms, the same error against the reference).
    grouped_tile: one grouped tile for every pass (`grouped_kernel.GROUPED_CONFIG`'s form: one
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SWAP_AB]) tuple or a (gate_up, down) pair),
    for sweeps (bench/prefill.py --grouped-configs); None, the default: by the pass's length
    (`grouped_config_for`, whose notes say what was measured).
    grouped_max_tokens: tokens per grouped pass at most (longer chunks are cut), which bounds the
    workspace (`moe_workspace_bytes`: the gate/up output, tokens x top-k x intermediate, 168 MB at
    16,384 tokens of the 80B); longer passes read and decode each routed expert fewer times per token
    and fill their 128-pair tiles better (H200: a 4,096-token chunk's routed experts in 2.9 ms in one
    pass against 5.8 ms in passes of 1,024; the 80B's whole prefill in 16,384-token chunks, the largest
    default chunk: 16K prompt 602 -> 509 ms, 8K 295 -> 280 ms with passes of 16,384 against 4,096;
    8,192 between; bench/prefill.py --grouped-max-tokens, RESULTS.md session 29).
    grouped_columns_first: launch the grouped passes' programs column blocks first (grid (columns, tiles)): the
    programs resident at once are then a few tiles' column blocks, which read their tiles' activation rows
    (x for gate/up, h for down) from L2, instead of one column block of hundreds of tiles, whose rows (64 MB of
    x, 168 MB of h at 16,384 tokens of the 80B) overflow L2 and came again from HBM for every column block.
    ncu (H100, session 50, one pass of 16,384 tokens, 80B shapes): gate/up 3.92 -> 1.18 GB read from HBM (L2
    hits 44 -> 79%), 3.48 -> 3.24 ms; down 5.72 GB -> 475 MB (L2 hits 17 -> 86%), 2.50 -> 2.02 ms. The block
    (bench/moe_prefill.py, both passes and the sum): 4,096 tokens 1.945 / 1.943 -> 1.689 ms, 16,384 tokens
    5.841 / 5.805 -> 4.837 ms (-17%, 176 -> 213 TFLOP/s; with grouped_h_sorted); the 80B's 16K prefill
    (bench/prefill.py --chunk 16384) 518.8 -> 471.2 ms (31,579 -> 34,774 tok/s, +10%), Flash-Next's (40
    layers) 958.6 -> 893.9 ms (+7%). Off (variant "moe-grouped-tiles-first", with h by pair id): the former
    order. The same bits either way.
    grouped_h_sorted: the grouped passes' intermediate h [pairs, I] in rows of the slot-sorted order (each tile's
    rows contiguous, so the down pass reads a block, not a gather of rows by pair id): 1.705 -> 1.689 ms at
    4,096 tokens, 4.850 -> 4.837 at 16,384 with columns first, 1.945 -> 1.906 and 5.841 -> 5.699 without
    (session 50, H100); off: variant "moe-grouped-h-by-pair". The same bits either way (a pair's row depends
    only on its token and expert).
    decode_tiles_one_token: the decode MoE's tiles for one token, ((BLOCK_I, BLOCK_W, warps) of gate/up,
    (BLOCK_H, BLOCK_W, warps) of down per pair): ((4, 0, 2), (16, 0, 4)), narrower than the tables' (the 80B's
    sweep, `decode_kernel.DECODE_GATE_UP_CONFIG[1]` and `down_pairs_config()`, which None selects: variant
    "moe-decode-wide-one-token"). At Qwen3.8-Flash-Next's shape the block alone took 22.4 us a layer against
    the tables' 26.1 (H200, session 34), but the step's tok/s did not show it (sessions 34-35, deleted then);
    the step's GPU time does (session 40, H200, 48 layers, batch 1, bench/decode.py --gpu-time 5): gate/up
    153 us and down 82 us a step less, 4.83 -> 4.60 ms busy.
    (The decode MoE skips a graph bucket's padding rows always; the variant that computed them lost by
    5-10% at batches 10 / 20 / 36 and was deleted, RESULTS.md session 29.)
    (The decode step's routing in the router GEMV's launch, the last program of a token block routing it,
    lost to the GEMV and the top-k kernel as two launches by 1.5-3% at batches 1 / 8 on the H100 and was
    deleted, RESULTS.md session 38; commit 70aa512 holds it.)
    decode_gate_up_two_tiles: the decode MoE's gate/up tile (BLOCK_I, BLOCK_W, warps) from two tokens where the
    hidden size is two whole-K tiles (`limits.whole_k_pieces`: Qwen3.8-Flash-Next's 2,560 = 256 + 64 words):
    (8, 0, 2), half the warps of the table's (`decode_kernel.DECODE_GATE_UP_CONFIG[2]`, the 80B's sweep, which
    None selects: variant "moe-decode-two-tiles-table"). The two tiles held whole take 158 registers a thread
    on the H100 (ncu, session 48: 12 warps an SM, 18% occupancy, DRAM at 62%); two warps a program fit the
    register file in finer steps. The block at 512 x 2,560 x 640, top-10 + shared (bench/moe_decode.py --sweep,
    H100): 110.3 -> 99.2 us at 8 tokens, 379.3 -> 335.2 us at 32.
    decode_down_rows: the rows of the down projection a per-pair down program computes from two tokens
    (`decode_kernel.down_pairs_config`, the whole K; a power of two, at least
    `decode_tiles.DECODE_DOWN_MIN_BLOCK_H`, by which the sum counters are sized): 64. 16 rows in 1 warp lost on
    the 80B (H100, session 50, as `Nvfp4Options.dot_f16_x_max_m`'s A/B: 1.0 / 1.7 / 2.5% slower at batch 8 / 16 /
    32 than the mean of the defaults' two rounds; the variant "moe-decode-down-16-rows" was deleted).
    decode_down_two_tiles: (rows, warps) of that tile where the intermediate size is two whole-K tiles
    (Qwen3.8-Flash-Next's 640 = 64 + 16 words): (16, 1). 64 rows in 2 warps take 240 registers a thread there
    (sm_90; ncu, session 49: 255 with the host store, DRAM at 46%, ~4 programs an SM), 16 rows in 1 warp 92.
    Flash-Next's step (H100, 40 layers, session 49, `bench/decode.py --replay-span 50`, one process): batch 8
    910.7 / 908.6 -> 932.5 / 930.2 tok/s (+2.4%), batch 32 1,456.1 -> 1,497.0 (+2.8%). None (variant
    "moe-decode-down-two-tiles-table"): decode_down_rows and decode_down_warps.
    decode_down_warps: the warps of a per-pair down program from two tokens (`decode_kernel.down_pairs_config`,
    64 rows, the whole K): 2. Against 4 (variant "moe-decode-down-4-warps"; bench/moe_decode.py's block, H100,
    session 48): the 80B's block 60.6 -> 58.5 us at 8 tokens, 183.2 -> 175.4 at 32; Flash-Next's 97.0 -> 95.8,
    313.6 -> 312.1 (a tie).
    decode_sum_in_down: where no norm follows the decode MoE (Qwen3.8-Flash-Next, whose HyperConnection
    write takes the block's output), the per-pair down pass sums a token's pairs itself (the last of its
    programs of a column block; `moe_decode(sum_counters=...)`), the same bits as the sum kernel and one
    launch a MoE layer fewer; off (variant "moe-sum-own-launch"): the sum kernel. On by its launch count
    (48 a step fewer on Qwen3.8-Flash-Next) and by its A/B, a tie at batch 8: the 40-layer model's step on
    the H100 (session 38, one process, two rounds) at 196.0 / 190.8 tok/s at batch 1 against 190.9 / 188.0
    with the sum kernel, 656.1 / 653.5 against 655.8 / 654.8 at batch 8.
    (Two forms lost on the H100 in session 47 and were deleted, their figures in bench/RESULTS.md: two pairs
    that read the same expert in one decode program, the tile decoded once for both tokens, 0.87-0.92x the
    block at 16-64 tokens, the 80B's step -7% / -12% / -17% at batch 16 / 32 / 64 (more registers, fewer
    programs); a bf16 model's grouped MMAs in fp16, the same time as bf16 at 4K and 16K tokens; L2 prefetch
    hints for the rows of the program a wave ahead, Flash-Next's step -7.8% / -7.0% at batch 8 / 32 on the H200
    for the gate/up pass, -1.0% / a tie for the down pass, session 64, commit 7a1b5a7.)
    route_lookup_fused: an offloaded decode step of one token whose landing slots may hold their victims (mapped
    victims, the read-through default) routes and looks up its experts in one program
    (`expert_lookup.route_and_lookup`: the ids stay in registers), one launch a MoE layer fewer; off (variant
    "route-lookup-apart"): the router's launch, then the lookup's. The same results and book either way
    (interpreter tests, tests/gpu/test_shape_matrix_moe_cuda.py). On by its A/B (session 53, H100, the 80B on the
    32 GiB card's 64K rung, `bench/ladder.py --tokens 1024,4096`, four fresh engines alternating): 232.7 / 232.2
    tok/s at 4,096 tokens against 229.5 / 230.3 with two launches (+1.2%), 230.5 / 230.1 against 227.5 / 229.3 at
    1,024."""

    route_lookup_fused: bool = True
    grouped_words: bool = True
    grouped_tile: tuple | None = None
    grouped_max_tokens: int = 16384
    grouped_h_sorted: bool = True
    grouped_columns_first: bool = True
    decode_sum_in_down: bool = True
    decode_gate_up_two_tiles: tuple | None = (8, 0, 2)
    decode_down_rows: int = 64
    decode_down_two_tiles: tuple | None = (16, 1)
    decode_down_warps: int = 2
    decode_tiles_one_token: tuple | None = ((4, 0, 2), (16, 0, 4))


@dataclass(frozen=True)
class GatedDeltaOptions:
    """Gated DeltaNet's chunked prefill (`ft.kernels.gated_delta.chunk_kernel`).

    solve_precision: the fp32 solve for T on the GPU with 16-bit activations ("tf32", "tf32x3" or
    "ieee"; fp32 activations always solve in "ieee"). H200, 4,096 tokens: the same error of o with
    each (4.17e-3, bf16 storage dominates) at 0.25 ms for the prep kernel against 0.64 and 5.0.
    prep_launch, state_launch: changes to the two kernels' launch choices (`prep_config`,
    `state_config`: pairs such as ("num_warps", 8), ("num_stages", 1), ("BLOCK_V", 32)) for sweeps
    (bench/gated_delta_prefill.py); empty, the default: the rules whose notes say what was measured.
    decode_ba_in_conv: a decode step's in_proj_ba (dense) computed by extra programs of the conv launch
    (`gated_delta_decode`'s ba_proj), one launch a Gated DeltaNet layer fewer; off (variant
    "gated-delta-ba-own-launch"): its own GEMV launch. On by its launch count (36 a step fewer) and its A/B
    (session 38, the 40-layer model's step on the H100, two rounds): 196.0 / 190.8 tok/s against 185.9 /
    186.2 at batch 1, 656.1 / 653.5 against 638.1 / 631.9 at batch 8.
    decode_launch: changes to the decode step's recurrent kernel's launch (`kernel.delta_config`: ("BLOCK_V",
    32), ("num_warps", 4)) for sweeps (bench/gated_delta_decode.py --sweep); empty, the default: the rule
    (BLOCK_V narrowed to about 256 programs, a warp per 2,048 state elements; session 40's sweep there)."""

    solve_precision: str = "tf32"
    prep_launch: tuple[tuple[str, int], ...] = ()
    state_launch: tuple[tuple[str, int], ...] = ()
    decode_ba_in_conv: bool = True
    decode_launch: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Conv1dOptions:
    """The packed causal conv of a prefill (`ft.kernels.conv1d.kernel.causal_conv1d_varlen_triton`).

    varlen_launch: changes to its tile and warps (`conv_varlen_config`: ("BLOCK_T", 32),
    ("BLOCK_C", 128), ("num_warps", 8)) for sweeps; empty, the default: the rule whose note says what
    was measured.
    rows: the kernel that walks a program's tokens a row at a time with the window in registers
    (`_conv_varlen_rows_kernel`: each input row loaded once, against W times in the tile kernel), for W <= 4;
    off (variant "conv1d-tiles"), the tile kernel, which a wider window takes anyway. Session 60 (H100,
    bench/gated_delta_prefill.py --quick, C 8192, W 4): 0.33 against 0.70 ms at 16,384 tokens in 1 and in 16
    sequences, 0.11 against 0.18 at 4,096 in 3; the 80B's 16K prefill (bench/prefill.py, 16K chunk) 471.8 ->
    462.4 ms (+2.0%).
    rows_launch: changes to its launch (`conv_rows_config`: ("BLOCK_T", 64), ("BLOCK_C", 1024),
    ("num_warps", 4), ("num_stages", 3)) for sweeps."""

    varlen_launch: tuple[tuple[str, int], ...] = ()
    rows: bool = True
    rows_launch: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class PrefillAttentionOptions:
    """Which path a CUDA prefill chunk's attention takes (`ft.kernels.attention.paged_attention`).

    triton_on_cuda: the Triton kernel (off: the torch reference, for timing both in one run).
    library_on_cuda: chunks after a long cached prefix on an unquantized cache run the library path
    (cuDNN's fused attention over the prefix in segments, merged with the Triton kernel's part; H200,
    flagship, one layer's 4,096-token chunk, bench/prefill_attention.py: 61,440 cached positions 8.44 ->
    7.35 ms, 131,072 17.83 -> 13.86, 258,048 34.66 -> 29.23; a 256K prompt 21.96 -> 20.08 s)."""

    triton_on_cuda: bool = True
    library_on_cuda: bool = True


@dataclass(frozen=True)
class DecodeAttentionOptions:
    """The paged decode attention's launch choices (`ft.kernels.attention.kernel`,
    `decode_tuning.decode_config`, `split.decode_attention_splits`).

    nvfp4_f16: an NVFP4 cache's fp16 dots over word-decoded fp16 tiles (q rounded to fp16 once; an
    fp32 q keeps the exact path), 64 keys a step. H200 (bench/decode_attention.py, 16/2 heads, D 256,
    2026-12-01): 92.2 us at a 128K context against 120.3 for the byte-wise halves, 19.7 against 24.8
    at 4K; rel RMS against the reference 1.7e-3 (halves 2.2e-3). Taken where nvfp4_prmt is not.
    nvfp4_prmt: the NVFP4 halves decoded straight to fp16 in inline PTX (`ft.kernels.nvfp4.decode.
    e2m1_halves_f16`, ~3 instructions an element), fp16 dots. H200 (2026-12-02): 128K 87.5 us for
    nvfp4_f16 -> 71.2 us (64 keys, 3 stages; 78.1 with 2 stages, 73.3 at 128 keys, 82.5 at 32, 97.6
    in 8 warps), 4K 19.4 -> 17.1 us.
    prmt_block_n, prmt_stages, prmt_warps: its keys a step, pipeline stages and warps a program.
    Its decode form is fixed: E4M3 bytes converted two at a time (`e2m1_halves_f16_scaled`). H200,
    one layer: 128K 70.9 / 71.1 us with the table's byte permutes -> 68.3 / 68.5, 72.3 with the bits
    placed; with prmt_maxnreg and three programs an SM 65.2-65.9 us (the bits form 66.3, byte permutes
    71.1). The two that lost left the tree after commit d98949c (the option `prmt_form` with them).
    prmt_maxnreg: registers per thread its split kernel is held to (ptxas maxnreg; 0: the compiler's
    choice) when the grid holds more than two programs an SM: the loop is latency-bound at two, and
    168 make room for three, at the cost of some spills (8 warps at 128 registers: 72.0 us at 128K;
    4 warps at 128, four programs: 69.2).
    prmt_programs_per_sm: programs an SM its split count aims at (0: `split`'s own rule, two an SM
    of an H200); prmt_max_splits: its split count at most.
    combine_block_d: head-dim columns per program of the split-K combine (the whole head when
    smaller). H200, flagship heads, batch 1: 128 splits (128K) 9.3 -> 4.4 us against one program a
    head, 16 splits (4K) 2.2 -> 1.8 us.
    split_target_programs: programs (sequence x kv head x split) the split count aims at for the
    other loops: two an SM of an H200 (132 SMs); max_splits: their split count at most (workspace
    rows per sequence)."""

    nvfp4_f16: bool = True
    nvfp4_prmt: bool = True
    prmt_block_n: int = 64
    prmt_stages: int = 3
    prmt_maxnreg: int = 168
    prmt_programs_per_sm: int = 3
    prmt_max_splits: int = 256
    prmt_warps: int = 4
    combine_block_d: int = 64
    split_target_programs: int = 264
    max_splits: int = 128


@dataclass(frozen=True)
class HyperConnectionOptions:
    """Qwen3.8-Flash-Next's HyperConnection read (`ft.kernels.hyper_connection.hc_read`).

    fused_read_max_tokens: reads of at most this many tokens run in Triton (`hc_read_triton`) instead of
    two cuBLAS GEMMs, a split-K reduce, a SiLU and the mix kernel (five launches); 0: always cuBLAS.
    Longer reads (prefill) keep cuBLAS, whose tensor-core GEMMs win there.
    fma_read_max_tokens: of those, reads of at most this many tokens take the form "fma" (two launches:
    `_read_down_kernel`, the down/inject projection in partial sums over K chunks;
    `_read_up_mix_streams_kernel`, the partials' sum, SiLU, the up projection and the gated mean, CUDA-core
    dots a token at a time), longer ones the form "dot" (three launches: the same on tensor cores, every
    token at once, the tokens padded to 16 rows, with a small reduce + SiLU kernel between).
    down_rows / down_chunk / up_block_d: the "fma" form's tiles (rows of mix_in by columns of the
    streams a program; columns of D a program, of every stream). dot_down_rows / dot_down_chunk /
    dot_down_block_k / dot_up_block_d / dot_up_block_rank: the "dot" form's (the same, the down
    projection in K steps of dot_down_block_k, the up projection in rank steps of dot_up_block_rank, all
    copied at once by cp.async, at most 16,384 tokens x rank elements a step so the tiles fit shared
    memory).
    Both up kernels load the up rows of every stream of their columns as one tile. Their first forms
    (per stream: C dependent load-reduce chains; sm_90 SASS showed six dependent rounds of global loads
    in the fma form's) lost on the H100 in session 38: bench/hc_read.py at 4 streams of 2,560, rank 320,
    us a read, per stream / all streams: fma T 1 14.6 / **12.5**; dot T 8 18.6 / **13.7**, T 16 18.3 /
    **13.7**, T 32 22.0 / **14.7**, T 64 21.5 / **15.2**; Qwen3.8-Flash-Next's step (40 layers, one
    process, two rounds) 196.0 / 190.8 -> 197.1 / 194.4 tok/s at batch 1, 656.1 / 653.5 -> 679.9 / 669.9
    at batch 8. Commit d6caade holds them (variant "hc-read-up-per-stream").
    up_warps: the "fma" form's up kernel's warps; 0, the default: 8 where a program's tile holds 16,384
    values or more (4 streams x 8 columns x rank 320), else 4 (Qwen3.8-Flash-Next's 4 columns). up_block_d 4
    (with 4 warps by that rule) since session 39's sweep (H100, bench/hc_read.py --tokens 1 --sweep, us a read
    at one token, (down_rows, down_chunk, up_block_d, up_warps)): (4, 2048, 8, 0 = 8 warps) 12.6, (4, 2048, 8,
    4) 11.8, **(4, 2048, 4, 4) 11.2**, (4, 2048, 4, 8) 11.3, (4, 2048, 16, 4) 13.9, (4, 2048, 16, 8) 15.6, (2,
    2048, 8, 0) 12.4, (4, 1024, 8, 0) 12.8; in the step (session 40, H200, 48 layers, batch 1, bench/decode.py
    --gpu-time 5) the 8 columns took 0.166 ms a step more busy time (its variant then deleted).
    write_into_read: a write followed by a read of the form "fma" (`hc_write_read`) runs as the read's
    two launches, the write folded into the first (`_write_down_deferred_kernel`), where it was its own
    launch of C programs; off (variant "hc-write-own-launch"): the write kernel, then the read. On by its
    launch count (96 a step fewer on Qwen3.8-Flash-Next at one token) and its A/B (session 38, the same
    run): 196.0 / 190.8 tok/s against 185.9 / 184.7 at batch 1, 656.1 / 653.5 against 653.5 / 644.7 at
    batch 8. On the GPU the write kernel runs without fp contraction, so both forms store the same bits as
    the reference. The folded write's first launch leaves the norm to the second: each program writes only
    its own chunk of one stream (chunks of at most down_chunk columns cut at the streams' bounds) and dots
    mix_in with x' (1 + w) there; the streams' 1 / rms, from the chunks' sums of squares, scale the
    partials in the up kernel, which also normalises x' for the mix (z takes N unrounded: a few bf16 ulps
    from the reference's, inside the read's error). And the up kernel takes a rank that is no power of two
    in two tiles (Flash-Next's 320: 256 + 64) instead of one of the next power of two (512, 192 masked
    columns holding registers; sm_90 1,168 -> 840 instructions). The forms before lost (session 40, H200,
    48 layers, batch 1, GPU busy ms a step, bench/decode.py --gpu-time 5): the norm in the first launch
    (`_write_down_kernel`: every program recomputed every stream's write for its norm, 5.8 us a call) and
    the rank in one tile 4.833; the deferred norm alone 4.897, the rank in pieces alone 4.763, both
    **4.660**; bench/hc_read.py --write-read, us a write + read: 12.3 / 13.0 / 11.6 / **10.5**. Their
    options `write_norm_deferred` and `up_rank_pieces` deleted (commit e04ea00 holds the forms before).
    (The form "dot" in two launches, each row tile's last down program doing the reduce launch's work by a
    ticket, the same bits, lost in the step: H200, session 45, Flash-Next 48 layers, batch 8, `bench/decode.py
    --replay-span 50`, 10.568 / 10.590 ms a replay plainly against 10.847 with it, 743.4 against 761.4 / 762.5
    tok/s; its variant "hc-dot-reduce-in-down" deleted, commit 7c7bc5a holds it.)

    H200, bench/hc_read.py (4 streams of 2,560, rank 320, bf16, in a CUDA graph), us a read, cuBLAS /
    fma / dot: T 1 17.4 / **14.1** / 17.4; T 2 20.8 / 19.4 / **17.9**; T 8 21.3 / 49.1 / **18.0**; T 64
    23.7 / 332.9 / **21.0** (session 31, the per-stream up kernels; the dot tiles from `--sweep`'s 24:
    (dot_down_rows, dot_down_chunk, dot_up_block_d, dot_up_block_rank) (32, 1024, 32, 512) best at 1-8
    tokens, 0.7-0.9 us under session 30's (16, 1024, 16, 64), 2.0 us under it at 64). The Flash-Next step
    with the fused reads (session 30's dot tiles) against cuBLAS (bench/decode.py, two alternated runs):
    batch 1 151.3 / 139.3 against 144.4 / 130.9 tok/s, batch 8 563.0 / 544.3 against 539.1 / 534.0. Hence
    fma at one token, dot from two to 64."""

    fused_read_max_tokens: int = 64
    fma_read_max_tokens: int = 1
    down_rows: int = 4
    down_chunk: int = 2048
    up_block_d: int = 4
    up_warps: int = 0
    dot_down_rows: int = 32
    dot_down_chunk: int = 1024
    dot_down_block_k: int = 256
    dot_up_block_d: int = 8
    dot_up_block_rank: int = 64
    write_into_read: bool = True


@dataclass(frozen=True)
class QsaOptions:
    """Qwen3.8-Flash-Next's QSA in a prefill past its dense span (`ft.model.layers.qsa_attention`).

    prefill_select_kernel: each query block's selection by `select_decode_tokens` (the decode path's
    Triton top-k on the scores' bits, the same set of tokens by its contract) from the same torch scores,
    instead of `select_tokens`' stable torch sort of every query's scores (variant qsa-prefill-select-torch).
    H200, bench/prefill.py on the Flash-Next small-table config, one process each, median of 3: 4K
    prompt 323.8 -> 321.6 ms, 16K 1,144.6 -> 1,134.2 ms (torch sort -> kernel).
    one_pass: a sparse attention launch of one split (a prefill's rows: thousands of queries, one program
    each walks its whole list) writes the normalized, gated output itself (`sparse_decode`'s ONE_PASS, the
    combine's bits) instead of fp32 partials that the combine kernel then reads (variant
    "qsa-sparse-combine"; a tie in whole prefills, session 66 on an H100: bench/prefill.py on 12 of Flash-Next's
    layers, 281.7 / 283.5 against 281.4 / 282.3 ms at 16K; kept for the partials it does not allocate).
    one_split_tile: (positions a tile, warps, pipeline stages) of such launches on a bf16 cache; launches of
    several splits (decode) keep 32 positions, 4 warps, 3 stages. Session 66, H100, bench/qsa_attention.py (4,096
    rows of a 16K prompt, bf16 KV, us a launch, random / local lists): (32, 4, 2) 3,555 / 3,477 against (32, 4, 3)
    4,660 / 4,517, (64, 4, 3) 4,496 / 4,376, (64, 4, 4) 4,687 / 4,534, (32, 8, 3) 5,162 / 5,010; its
    whole-prefill A/B is owed. one_split_tile_quantized: the same on an fp8 or NVFP4 cache (other loads and
    registers: at 2 stages the NVFP4 form keeps 16 bytes of stack on sm_90), the former tile until timed."""

    prefill_select_kernel: bool = True
    one_pass: bool = True
    one_split_tile: tuple[int, int, int] = (32, 4, 2)
    one_split_tile_quantized: tuple[int, int, int] = (32, 4, 3)


@dataclass(frozen=True)
class EngramOptions:
    """Qwen3.8-Flash-Next's PLE layer (`ft.kernels.engram`).

    prefill_triton: a prefill's PLE in two Triton launches (`ple_prefill`: the decode step's gate kernel a token a
    row, then `_ple_conv_prefill_kernel`) where Triton runs, instead of the model's torch form in token chunks
    (`ft.model.layers.engram.ple_delta_batched`, 256 MiB of temporaries a chunk). Off (variant
    "ple-prefill-triton" turns it on) until it has run on a GPU: written and tested in the interpreter in session
    66, when the device's time ran out before its GPU test (`tests/gpu/test_flash_next_kernels_cuda.py::
    test_the_prefill_ple_on_the_device`) and `bench/ple_prefill.py` could run. The torch form on an H100 (session
    66): 18.2 ms and 891 MiB over its inputs at 16,384 tokens in chunks, 12.3 ms and 3,281 MiB unchunked."""

    prefill_triton: bool = False


@dataclass(frozen=True)
class LaunchOptions:
    """How the decode path's kernels launch (`ft.kernels.pdl`).

    pdl: programmatic dependent launch on compute capability 9.0 or later; the kernels give the same bits
    either way. None (the default): inside the decode graphs of a model that chooses it (its
    `decode_graph_pdl`, read by `ft.engine.worker.decode_graphs.DecodeGraphs`), nowhere else; True: every
    launch (variant "pdl"); False: none (variant "no-pdl"). Measured against plain launches in one process
    (bench/decode.py --modes overlap,pdl,overlap,pdl; RESULTS.md sessions 34 and 41): on the H100 in session
    41, Qwen3.8-Flash-Next (40 layers) 268.5 / 268.4 against 246.1 / 246.4 tok/s at batch 1 (+9%), 786.0 /
    785.1 against 762.7 / 763.3 at 8 (+3%); the 80B 322.0 / 322.2 against 343.4 / 343.1 at batch 1 (-6%),
    1,255 / 1,254 against 1,228 / 1,228 at 8 (+2%; a tie in a second call), -1.5% at 16, -2% at 32, drift at
    64. So the Flash-Next model chooses it and the 80B does not (at no batch)."""

    pdl: bool | None = None


@dataclass(frozen=True)
class KernelOptions:
    """Every operation's options; `kernel_options()` is the one in force."""

    nvfp4: Nvfp4Options = field(default_factory=Nvfp4Options)
    dense: DenseOptions = field(default_factory=DenseOptions)
    moe: MoeOptions = field(default_factory=MoeOptions)
    gated_delta: GatedDeltaOptions = field(default_factory=GatedDeltaOptions)
    conv1d: Conv1dOptions = field(default_factory=Conv1dOptions)
    prefill_attention: PrefillAttentionOptions = field(default_factory=PrefillAttentionOptions)
    decode_attention: DecodeAttentionOptions = field(default_factory=DecodeAttentionOptions)
    hyper_connection: HyperConnectionOptions = field(default_factory=HyperConnectionOptions)
    qsa: QsaOptions = field(default_factory=QsaOptions)
    engram: EngramOptions = field(default_factory=EngramOptions)
    launch: LaunchOptions = field(default_factory=LaunchOptions)

    def option(self, key: str) -> tuple[str, str, object]:
        """(operation, field, its value) of the option keyed "operation.field". Raises ValueError for a key that
        names nothing."""
        op, _, name = key.partition(".")
        group = getattr(self, op) if op in {f.name for f in dataclasses.fields(self)} else None
        if group is None or name not in {f.name for f in dataclasses.fields(group)}:
            raise ValueError(f"kernel options: no option {key!r}")
        return op, name, getattr(group, name)

    def with_(self, **changes: object) -> KernelOptions:
        """These options with `changes` keyed "operation.field" (e.g. ``nvfp4.lanes_ptx=False`` as
        ``**{"nvfp4.lanes_ptx": False}``). Raises ValueError for a key that names nothing."""
        groups: dict[str, dict[str, object]] = {}
        for key, value in changes.items():
            op, name, _ = self.option(key)
            groups.setdefault(op, {})[name] = value
        return dataclasses.replace(self, **{op: dataclasses.replace(getattr(self, op), **fields)
                                            for op, fields in groups.items()})


DEFAULTS = KernelOptions()
"""The chosen defaults (each field's docstring says why)."""

VARIANTS: dict[str, dict[str, object]] = {
    "nvfp4-tile-small-m": {"nvfp4.small_m_whole_k": False},  # bench/decode.py --no-small-m-gemv
    "nvfp4-lanes-triton": {"nvfp4.lanes_ptx": False},  # bench/decode.py --no-lanes-ptx, bench/moe_decode.py
    "nvfp4-no-half-sums": {"nvfp4.half_sums": False},  # the fp32 sums everywhere, as before session 44
    "nvfp4-dot-split-k-2": {"nvfp4.dot_split_k": 2},  # bench/decode.py --modes overlap:nvfp4-dot-split-k-2 --batches 32,64
    "nvfp4-dot-split-k-4": {"nvfp4.dot_split_k": 4},
    "nvfp4-dot-no-split-k": {"nvfp4.dot_split_k_few_tiles": 1},  # the narrow tile on out_proj-like shapes
    "nvfp4-dot-split-k-small-m-2": {"nvfp4.dot_split_k_small_m": 2},  # --batches 8: out_proj-like shapes at M <= 16
    "nvfp4-dot-no-split-k-small-m": {"nvfp4.dot_split_k_small_m": 1},
    "nvfp4-dot-interleaved": {"nvfp4.dot_halves": False},  # bench/decode.py --no-dot-halves
    "nvfp4-dot-small-m-4-warps": {"nvfp4.dot_small_m_past_wave_warps": 4},  # bench/decode.py --modes
    "moe-bytes": {"moe.grouped_words": False},  # bench/moe_prefill.py, bench/prefill.py
    "moe-grouped-tiles-first": {"moe.grouped_columns_first": False, "moe.grouped_h_sorted": False},  # the same
    "moe-grouped-h-by-pair": {"moe.grouped_h_sorted": False},  # the same
    # the down pass's former tile past GROUPED_SHORT_TOKENS (also forced on shorter passes, both tiles pinned)
    "moe-grouped-down-k128": {"moe.grouped_tile": ((128, 64, 64, 4, 4, True), (128, 64, 128, 4, 3, True))},
    "attention-prefill-reference": {"prefill_attention.triton_on_cuda": False},  # bench/prefill.py --modes
    "attention-prefill-triton-only": {"prefill_attention.library_on_cuda": False},  # bench/prefill.py --library
    "gated-delta-solve-ieee": {"gated_delta.solve_precision": "ieee"},  # bench/gated_delta_prefill.py
    "pdl": {"launch.pdl": True},  # bench/decode.py --modes pdl, bench/ladder.py --pdl
    "no-pdl": {"launch.pdl": False},  # bench/decode.py --modes overlap:no-pdl (the A/B of the model's choice)
    "moe-decode-wide-one-token": {"moe.decode_tiles_one_token": None},  # bench/decode.py --modes
    "moe-decode-two-tiles-table": {"moe.decode_gate_up_two_tiles": None},  # the same, bench/moe_decode.py --variants
    "moe-decode-down-4-warps": {"moe.decode_down_warps": 4},  # the same
    "nvfp4-dot-bf16-x": {"nvfp4.dot_f16_x_max_m": 0},  # bench/decode.py --modes (over a model's choice)
    "moe-decode-down-two-tiles-table": {"moe.decode_down_two_tiles": None},  # the same
    "attention-nvfp4-f16": {"decode_attention.nvfp4_prmt": False},  # bench/decode.py --no-prmt, decode_attention.py
    "hc-read-cublas": {"hyper_connection.fused_read_max_tokens": 0},  # bench/hc_read.py, bench/decode.py --modes
    "hc-read-dot-only": {"hyper_connection.fma_read_max_tokens": 0},  # the same
    "hc-write-own-launch": {"hyper_connection.write_into_read": False},  # the same
    "moe-sum-own-launch": {"moe.decode_sum_in_down": False},  # the same
    "route-lookup-apart": {"moe.route_lookup_fused": False},  # bench/ladder.py --variant
    "gated-delta-ba-own-launch": {"gated_delta.decode_ba_in_conv": False},  # the same
    "qsa-prefill-select-torch": {"qsa.prefill_select_kernel": False},  # bench/prefill.py --variant
    "qsa-sparse-combine": {"qsa.one_pass": False},  # bench/qsa_attention.py, bench/prefill.py --variant
    "ple-prefill-triton": {"engram.prefill_triton": True},  # bench/prefill.py --variant, tests
    "conv1d-tiles": {"conv1d.rows": False},  # bench/gated_delta_prefill.py, tests (the kernel wide windows take)
}
"""Named variants a benchmark or test selects: the changes from `DEFAULTS` each one makes."""

_current: KernelOptions = DEFAULTS


def kernel_options() -> KernelOptions:
    """The options in force."""
    return _current


def variant(*names: str, base: KernelOptions | None = None, **changes: object) -> KernelOptions:
    """`base` (default `DEFAULTS`) with the named `VARIANTS` applied in order, then `changes` keyed
    "operation.field" given as ``**{"moe.grouped_max_tokens": 1024}``. Raises ValueError for an
    unknown name."""
    options = base or DEFAULTS
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"kernel options: no variant {name!r} (known: {', '.join(sorted(VARIANTS))})")
        options = options.with_(**VARIANTS[name])
    return options.with_(**changes) if changes else options


@contextlib.contextmanager
def use_kernel_options(options: KernelOptions) -> Iterator[KernelOptions]:
    """Inside: `options` are in force (the previous ones come back on exit, also on an error). Not
    thread-aware: benchmarks and tests hold it around the engine's own thread. Graphs captured inside
    keep what they captured after the block ends."""
    global _current
    before, _current = _current, options
    try:
        yield options
    finally:
        _current = before


def model_defaults(changes: tuple[tuple[str, object], ...]) -> KernelOptions:
    """The options in force with a model's choices (`changes`, ("operation.field", value) pairs: a model's
    `kernel_defaults`) for the fields they leave None, the fields whose default is "the model's"; a value in
    force (a variant's) is kept. A model's forward runs inside `use_kernel_options(model_defaults(...))`, so its
    eager steps and its captured graphs take the same kernels. Cached by the options in force."""
    return _model_defaults(_current, changes)


@functools.lru_cache(maxsize=64)
def _model_defaults(base: KernelOptions, changes: tuple[tuple[str, object], ...]) -> KernelOptions:
    unset = {key: value for key, value in changes if base.option(key)[2] is None}
    return base.with_(**unset) if unset else base


def set_kernel_options(options: KernelOptions) -> None:
    """Put `options` in force for the rest of the process (a benchmark's command line)."""
    global _current
    _current = options
