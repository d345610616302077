"""Triton MoE over NVFP4 expert slots against `moe_over_slots_ref`, under the interpreter on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.moe import SlotWeights, dense_slots, moe_decode, moe_decode_ref, moe_over_slots, moe_over_slots_ref
from ft.kernels.moe.decode_kernel import moe_decode_triton
from ft.kernels.moe.kernel import moe_over_slots_triton
from ft.kernels import options
from ft.kernels.options import DEFAULTS, use_kernel_options, variant
from ft.tools.nvfp4_quantize import quantize_nvfp4
from triton_flags import spy_launches

# Relative RMS: the kernels work in fp32; the reference runs its matmuls in x's dtype.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# (T tokens, top-k, S slots, H hidden, I intermediate, dtype, fraction of pairs skipped, grouped path)
# bf16 only on the per-pair path: the grouped path runs tl.dot, whose bf16 is wrong in the interpreter.
CASES = [
    (1, 2, 4, 64, 32, torch.float32, 0.0, False),
    (3, 4, 6, 32, 48, torch.float32, 0.3, False),
    (5, 2, 3, 64, 32, torch.bfloat16, 0.2, False),
    (4, 3, 5, 48, 16, torch.float16, 0.0, False),
    (9, 3, 4, 64, 32, torch.float32, 0.2, True),  # runs longer than a tile, skipped pairs
    (6, 2, 12, 32, 48, torch.float16, 0.0, True),  # many short runs
    (1, 2, 3, 32, 16, torch.float32, 1.0, True),  # everything skipped
]


def _case_id(case) -> str:
    t, k, s, h, i, dtype, skip, grouped = case
    return f"T{t}-k{k}-S{s}-H{h}-I{i}-{DTYPE_NAMES[dtype]}-skip{skip}-{'grouped' if grouped else 'pairs'}"


def _slot_pool(s: int, h: int, i: int, gen: torch.Generator) -> SlotWeights:
    w13, s13, w2, s2w, s2 = [], [], [], [], []
    for _ in range(s):
        gate, up = (quantize_nvfp4(torch.randn(i, h, generator=gen) * 0.2) for _ in range(2))
        down = quantize_nvfp4(torch.randn(h, i, generator=gen) * 0.2)
        w13.append(torch.cat([gate[0], up[0]]))
        s13.append(torch.cat([gate[1], up[1]]))
        w2.append(down[0])
        s2w.append(down[1])
        s2.append(torch.stack([gate[2], up[2], down[2]]))
    return SlotWeights(torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2w), torch.stack(s2))


def _routing(t: int, k: int, s: int, skip: float, gen: torch.Generator):
    slots = torch.stack([torch.randperm(s, generator=gen)[:k] for _ in range(t)])
    slots[torch.rand(t, k, generator=gen) < skip] = -1
    weights = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return slots, weights


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_moe_over_slots_triton_matches_ref(case):
    t, k, s, h, i, dtype, skip, grouped = case
    gen = torch.Generator().manual_seed(sum(map(ord, _case_id(case))))
    w = _slot_pool(s, h, i, gen)
    slots, weights = _routing(t, k, s, skip, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    y = moe_over_slots_triton(x, slots, weights.to(dtype), w, out=out, grouped=grouped, grouped_config=(4, 16, 32, 4, 1))
    ref = moe_over_slots_ref(x, slots, weights.to(dtype), w)
    assert not y.isnan().any()
    if (slots < 0).all():
        assert (y == 0).all()
        return
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[dtype], err


SWAPPED_TILE = (4, 16, 32, 4, 1, True)
"""A small grouped tile with the weight tile as the MMA's left operand (SWAP_AB)."""


def _grouped(case, seed: int, **options):
    """The grouped path on `case`'s random pool and routing (seeded), under `variant(*names, **changes)`
    (`options`: "names", a list of variant names, and changes keyed "operation.field"); returns (y, the
    reference's y)."""
    t, k, s, h, i, dtype, skip, _ = case
    gen = torch.Generator().manual_seed(seed)
    w = _slot_pool(s, h, i, gen)
    slots, weights = _routing(t, k, s, skip, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    with use_kernel_options(variant(*options.pop("names", ()), **options)):
        y = moe_over_slots_triton(x, slots, weights.to(dtype), w, grouped=True, grouped_config=SWAPPED_TILE)
    return y, moe_over_slots_ref(x, slots, weights.to(dtype), w)


def _rel(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] and c[6] < 1.0], ids=_case_id)
def test_grouped_swapped_operands_match_ref(case):
    """The grouped path with the weight tile as the MMA's left operand (SWAP_AB, a sixth config element)."""
    y, ref = _grouped(case, 7)
    assert _rel(y, ref) < TOL[case[5]], _rel(y, ref)


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] and c[6] < 1.0], ids=_case_id)
def test_grouped_word_decode_matches_the_byte_decode(case):
    """`MoeOptions.grouped_words` (the default: the weight tiles decoded a 32-bit word at a time, in
    fp16) against the byte-wise decode (variant "moe-bytes"): the same tiles, so bitwise the same
    result in fp32, and the reference's within tolerance."""
    bytes_, _ = _grouped(case, 9, names=["moe-bytes"])
    words, ref = _grouped(case, 9)
    assert torch.equal(words, bytes_)
    assert _rel(words, ref) < TOL[case[5]]


@pytest.mark.parametrize("name", ["moe-grouped-tiles-first", "moe-grouped-h-by-pair"])
@pytest.mark.parametrize("case", [c for c in CASES if c[-1] and c[6] < 1.0][:2], ids=_case_id)
def test_grouped_launch_orders_give_the_same_bits(case, name):
    """`MoeOptions.grouped_h_sorted` (h stored in the slot-sorted order, each tile's rows a block for the
    down pass) and `grouped_columns_first` (the grid's column blocks first), the defaults, give the bits of
    the former order (variant "moe-grouped-tiles-first") and of h by pair id ("moe-grouped-h-by-pair")."""
    assert DEFAULTS.moe.grouped_h_sorted and DEFAULTS.moe.grouped_columns_first
    default, ref = _grouped(case, 11)
    other, _ = _grouped(case, 11, names=[name])
    assert torch.equal(default, other)
    assert _rel(default, ref) < TOL[case[5]]


@pytest.mark.parametrize(("gate_up", "down"), [((4, 0, 4), (16, 0, 4)), ((8, 16, 4), (8, 8, 4))], ids=["whole-k", "k-loop"])
def test_per_pair_tiles_match_ref(gate_up, down):
    gen = torch.Generator().manual_seed(5)
    w = _slot_pool(5, 64, 32, gen)
    slots, weights = _routing(3, 3, 5, 0.3, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    out = torch.full((3, 64), float("nan"), dtype=torch.bfloat16)
    y = moe_over_slots_triton(x, slots, weights.to(torch.bfloat16), w, out=out, grouped=False,
                              gate_up_config=gate_up, down_config=down)
    ref = moe_over_slots_ref(x, slots, weights.to(torch.bfloat16), w)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < TOL[torch.bfloat16]


def test_grouped_path_cuts_long_chunks(monkeypatch):
    """With `MoeOptions.grouped_max_tokens` 4, 11 tokens run as grouped passes of 4, 4 and 3 tokens
    (each pass's pairs: k per token), and the result is the reference's."""
    import ft.kernels.moe.kernel as details

    monkeypatch.setattr(options, "_current", variant(**{"moe.grouped_max_tokens": 4}))
    passes = []
    real = details.grouped_moe
    monkeypatch.setattr(details, "grouped_moe", lambda x, slots, *a, **kw: passes.append((x.shape[0], slots.numel()))
                        or real(x, slots, *a, **kw))
    gen = torch.Generator().manual_seed(8)
    w = _slot_pool(4, 32, 16, gen)
    slots, weights = _routing(11, 2, 4, 0.2, gen)
    x = torch.randn(11, 32, generator=gen)
    out = torch.full((11, 32), float("nan"))
    y = moe_over_slots_triton(x, slots, weights, w, out=out, grouped=True, grouped_config=(4, 16, 32, 4, 1))
    assert passes == [(4, 8), (4, 8), (3, 6)]
    ref = moe_over_slots_ref(x, slots, weights, w)
    assert ((y - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@pytest.mark.parametrize("block_m", [1, 3, 8])
def test_pair_tiles_kernel_equals_the_reference_and_covers_every_pair_once(block_m, monkeypatch):
    """The tile kernel's list equals the torch scans' exactly; with the bound a layer gives (its
    expert count + 1) the tiles cover every pair of a pool-wide slot numbering exactly once, one
    slot per tile, at most block_m pairs each. A small scan block, so that runs and tiles cross
    the kernel's block boundaries."""
    import ft.kernels.moe.pair_tiles as tiles

    monkeypatch.setattr(tiles, "TILES_BLOCK", 16)
    gen = torch.Generator().manual_seed(block_m)
    for trial in range(12):
        experts = int(torch.randint(1, 9, (1,), generator=gen))
        table = torch.randperm(1000, generator=gen)[:experts]  # the layer's slots in a large pool
        table[torch.rand(experts, generator=gen) < 0.25] = -1  # experts without a slot
        p = 1 if trial == 0 else int(torch.randint(1, 60, (1,), generator=gen))
        slots = table[torch.randint(0, experts, (p,), generator=gen)]
        start, end, sorted_slots, order = tiles.group_pairs(slots, block_m, experts + 1)
        ref = tiles.group_pairs_ref(slots, block_m, experts + 1)
        for got, want in zip((start, end, sorted_slots, order), ref):
            assert torch.equal(got, want)
        assert start.numel() == -(-p // block_m) + min(p, experts + 1)
        seen = []
        for a, b in zip(start.tolist(), end.tolist()):
            assert 0 <= b - a <= block_m
            tile = order[a:b]
            assert len(set(slots[tile].tolist())) <= 1
            seen += tile.tolist()
        assert sorted(seen) == list(range(p))


def test_grouped_path_takes_one_tile_per_pass():
    """A pair of configurations: gate_up's and down's tiles apart, one BLOCK_M (one tile list)."""
    gen = torch.Generator().manual_seed(12)
    w = _slot_pool(5, 64, 32, gen)
    slots, weights = _routing(9, 3, 5, 0.2, gen)
    x = torch.randn(9, 64, generator=gen)
    cfg = ((4, 16, 32, 4, 1, True), (4, 32, 16, 4, 1))
    y = moe_over_slots_triton(x, slots, weights, w, grouped=True, grouped_config=cfg)
    ref = moe_over_slots_ref(x, slots, weights, w)
    assert ((y - ref).norm() / ref.norm()).item() < TOL[torch.float32]
    with pytest.raises(ValueError, match="share BLOCK_M"):
        moe_over_slots_triton(x, slots, weights, w, grouped=True, grouped_config=((4, 16, 32, 4, 1), (8, 16, 32, 4, 1)))


def test_grouped_path_in_a_pool_larger_than_the_layer_matches_ref():
    """A layer's 3 experts live in slots of a 9-slot pool; `experts=3` sizes the grid by the layer."""
    gen = torch.Generator().manual_seed(11)
    w = _slot_pool(9, 32, 16, gen)
    table = torch.tensor([7, 2, 5])
    ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(13)])
    slots = table[ids]
    weights = torch.softmax(torch.randn(13, 2, generator=gen), dim=-1)
    x = torch.randn(13, 32, generator=gen)
    y = moe_over_slots_triton(x, slots, weights, w, grouped=True, grouped_config=(4, 16, 32, 4, 1), distinct_slots=4)
    ref = moe_over_slots_ref(x, slots, weights, w)
    assert ((y - ref).norm() / ref.norm()).item() < TOL[torch.float32]


def test_all_skipped_gives_zeros():
    gen = torch.Generator().manual_seed(1)
    w = _slot_pool(2, 32, 16, gen)
    x = torch.randn(2, 32, generator=gen)
    y = moe_over_slots_triton(x, torch.full((2, 2), -1), torch.ones(2, 2), w, out=torch.full((2, 32), float("nan")))
    assert (y == 0).all()


def test_dispatcher_uses_triton_when_asked(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    w = _slot_pool(3, 32, 16, gen)
    slots, weights = _routing(2, 2, 3, 0.0, gen)
    x = torch.randn(2, 32, generator=gen)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.moe.kernel as details

    calls = []
    real = details.moe_over_slots_triton
    monkeypatch.setattr(details, "moe_over_slots_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = moe_over_slots(x, slots, weights, w)
    ref = moe_over_slots_ref(x, slots, weights, w)
    assert calls and ((y - ref).norm() / ref.norm()).item() < TOL[torch.float32]



def test_reference_kernels_block_sends_dispatchers_to_the_references(monkeypatch):
    """Inside `backend.reference_kernels()` (nested too) the dispatcher runs the reference where it
    would run Triton; after the block, Triton again."""
    from ft.kernels.backend import reference_kernels, reference_kernels_forced, uses_triton

    gen = torch.Generator().manual_seed(3)
    w = _slot_pool(3, 32, 16, gen)
    slots, weights = _routing(2, 2, 3, 0.0, gen)
    x = torch.randn(2, 32, generator=gen)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.moe.kernel as details

    calls = []
    real = details.moe_over_slots_triton
    monkeypatch.setattr(details, "moe_over_slots_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with reference_kernels():
        with reference_kernels():
            assert reference_kernels_forced() and not uses_triton(torch.device("cuda"))
        assert not uses_triton(x.device)
        y = moe_over_slots(x, slots, weights, w)
    assert not calls and torch.equal(y, moe_over_slots_ref(x, slots, weights, w))
    assert not reference_kernels_forced() and uses_triton(x.device)
    moe_over_slots(x, slots, weights, w)
    assert calls

# (T, k, S slots, H, I, dtype, skipped fraction, shared expert): H = 64 takes one whole-K tile, H = 48
# (6 words a row: 4 + 2) and 80 (8 + 2) two tiles (`whole_k_pieces`: as 2,560 and 640 do), H = 112
# (14 words: 8 + 6) the K loop
DECODE_CASES = [
    (1, 3, 5, 64, 32, torch.float32, 0.0, True),
    (4, 2, 6, 64, 32, torch.float16, 0.3, True),
    (3, 3, 4, 48, 16, torch.float32, 0.2, True),
    (2, 3, 4, 80, 48, torch.float32, 0.2, True),
    (2, 2, 4, 112, 48, torch.float16, 0.0, True),
    (5, 2, 3, 64, 48, torch.bfloat16, 0.2, False),
    (2, 2, 3, 32, 16, torch.float32, 1.0, True),  # only the shared expert runs
]


@pytest.mark.parametrize("per_pair", [False, True], ids=["down-loop", "down-pairs"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(c) for c in DECODE_CASES])
def test_moe_decode_triton_matches_ref(case, per_pair):
    t, k, s, h, i, dtype, skip, with_shared = case
    gen = torch.Generator().manual_seed(t * 100 + h + i)
    w = _slot_pool(s, h, i, gen)
    shared = _slot_pool(1, h, i, gen) if with_shared else None
    slots, weights = _routing(t, k, s, skip, gen)
    if with_shared:
        weights = torch.cat([weights, torch.rand(t, 1, generator=gen)], dim=1)
    x = torch.randn(t, h, generator=gen).to(dtype)
    y = moe_decode_triton(x, slots, weights.to(dtype), w, shared, out=torch.full((t, h), float("nan"), dtype=dtype),
                          down_per_pair=per_pair)
    ref = moe_decode_ref(x, slots, weights.to(dtype), w, shared)
    assert not y.isnan().any()
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[dtype], err
    if not per_pair:  # (once per case: the interpreter's time)
        return
    # a token's result does not depend on where its experts sit: the same experts in other slots
    perm = torch.randperm(s, generator=gen)
    moved = SlotWeights(*(t_[perm] for t_ in w))
    where = torch.argsort(perm)  # slot of old slot q in the moved pool
    moved_slots = torch.where(slots >= 0, where[slots.clamp(min=0)], slots)
    assert torch.equal(moe_decode_triton(x, moved_slots, weights.to(dtype), moved, shared, down_per_pair=per_pair), y)


NARROW_DOWN_ROWS = {"moe.decode_down_rows": 16, "moe.decode_down_warps": 1}
"""The narrowest per-pair down tile (16 rows in 1 warp) as `decode_down_rows` / `decode_down_warps`: the 80B's
variant of it lost its measurement (session 50, bench/RESULTS.md) and was deleted; the tile stays legal."""


def _options_named(name: str):
    """A variant by name, "" for the defaults, "down-16-rows" for NARROW_DOWN_ROWS."""
    return variant(**NARROW_DOWN_ROWS) if name == "down-16-rows" else variant(*([name] if name else []))


@pytest.mark.parametrize("variant_name", ["", "moe-decode-wide-one-token", "moe-decode-two-tiles-table",
                                          "moe-decode-down-two-tiles-table", "down-16-rows"])
def test_the_one_token_and_two_tile_tiles_are_taken_and_match_ref(monkeypatch, variant_name):
    """`MoeOptions.decode_tiles_one_token`: one token's gate/up and down passes launch with its tiles (two
    whole-K tiles a row here, as at 2,560 / 640) and give the reference's result; from two tokens the gate/up
    pass takes `MoeOptions.decode_gate_up_two_tiles` (the hidden size is two tiles) and down
    `MoeOptions.decode_down_two_tiles` (so is the intermediate size, 48 = 32 + 16). Variant
    "moe-decode-wide-one-token" gives one token the tables' tiles, "moe-decode-two-tiles-table" two tokens the
    table's gate/up tile, "moe-decode-down-two-tiles-table" two tokens `decode_down_rows` / `decode_down_warps`
    (64, 2), "down-16-rows" (NARROW_DOWN_ROWS) changes those, not the two-tile tile."""
    import ft.kernels.moe.decode_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    down = spy_launches(monkeypatch, details, "_moe_decode_down_pairs_kernel")
    gen = torch.Generator().manual_seed(21)
    w, shared = _slot_pool(4, 80, 48, gen), _slot_pool(1, 80, 48, gen)
    narrow, two_tiles = DEFAULTS.moe.decode_tiles_one_token, DEFAULTS.moe.decode_gate_up_two_tiles
    assert two_tiles != details.DECODE_GATE_UP_CONFIG[2]  # (else this test could not tell them apart)
    table_down = (DEFAULTS.moe.decode_down_rows, DEFAULTS.moe.decode_down_warps) \
        if variant_name == "moe-decode-down-two-tiles-table" else DEFAULTS.moe.decode_down_two_tiles
    # (else this test could not tell the two-tile tile from the other)
    assert DEFAULTS.moe.decode_down_two_tiles != (DEFAULTS.moe.decode_down_rows, DEFAULTS.moe.decode_down_warps)
    for t in (1, 2, 3):
        slots, weights = _routing(t, 3, 4, 0.0, gen)
        weights = torch.cat([weights, torch.rand(t, 1, generator=gen)], dim=1)
        x = torch.randn(t, 80, generator=gen)
        gate_up.clear()
        down.clear()
        with use_kernel_options(_options_named(variant_name)):
            y = moe_decode_triton(x, slots, weights, w, shared)
        table = details.DECODE_GATE_UP_CONFIG[min(t, 2)]
        if t == 1:
            want = [(table[0], table[2]), table_down] if variant_name == "moe-decode-wide-one-token" else \
                [(narrow[0][0], narrow[0][2]), (narrow[1][0], narrow[1][2])]
        else:
            tile = table if variant_name == "moe-decode-two-tiles-table" else two_tiles
            want = [(tile[0], tile[2]), table_down]
        assert [(gate_up[0]["BLOCK_I"], gate_up[0]["num_warps"]), (down[0]["BLOCK_H"], down[0]["num_warps"])] == want
        assert len(gate_up) == len(down) == 1
        ref = moe_decode_ref(x, slots, weights, w, shared)
        assert ((y - ref).norm() / ref.norm()).item() < TOL[torch.float32]


def test_one_tile_hidden_sizes_keep_the_table_from_two_tokens(monkeypatch):
    """A hidden size of one whole-K tile (the 80B's 2,048; 64 here) takes the table's gate/up tile from two
    tokens: `MoeOptions.decode_gate_up_two_tiles` is for two-tile rows only."""
    import ft.kernels.moe.decode_kernel as details

    gate_up = spy_launches(monkeypatch, details, "_moe_decode_gate_up_kernel")
    gen = torch.Generator().manual_seed(22)
    w, shared = _slot_pool(4, 64, 48, gen), _slot_pool(1, 64, 48, gen)
    slots, weights = _routing(2, 3, 4, 0.0, gen)
    weights = torch.cat([weights, torch.rand(2, 1, generator=gen)], dim=1)
    moe_decode_triton(torch.randn(2, 64, generator=gen), slots, weights, w, shared)
    table = details.DECODE_GATE_UP_CONFIG[2]
    assert (gate_up[0]["BLOCK_I"], gate_up[0]["num_warps"]) == (table[0], table[2])


def test_moe_decode_ref_is_the_unfused_block():
    """The fused reference equals the model's unfused ops (routed MoE + shared MLP + gated combine) in fp32."""
    gen = torch.Generator().manual_seed(11)
    w, shared = _slot_pool(6, 32, 16, gen), _slot_pool(1, 32, 16, gen)
    slots, weights = _routing(4, 3, 6, 0.25, gen)
    gate = torch.randn(4, 1, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    routed = moe_over_slots_ref(x, slots, weights, w)
    w13, w2 = dense_slots(shared, torch.zeros(1, dtype=torch.long), torch.float32)
    g, u = (x @ w13[0].T).chunk(2, dim=-1)
    unfused = routed + torch.sigmoid(gate) * ((torch.nn.functional.silu(g) * u) @ w2[0].T)
    fused = moe_decode_ref(x, slots, torch.cat([weights, torch.sigmoid(gate)], dim=1), w, shared)
    assert torch.allclose(fused, unfused, rtol=1e-5, atol=1e-6)


def test_moe_decode_dispatcher_and_limits(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    w = _slot_pool(3, 32, 16, gen)
    slots, weights = _routing(2, 2, 3, 0.0, gen)
    x = torch.randn(2, 32, generator=gen)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.moe.decode_kernel as details

    calls = []
    real = details.moe_decode_triton
    monkeypatch.setattr(details, "moe_decode_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = moe_decode(x, slots, weights, w)
    assert calls and ((y - moe_decode_ref(x, slots, weights, w)).norm() / y.norm()).item() < TOL[torch.float32]
    with pytest.raises(ValueError, match="k \\+ 1"):
        moe_decode_triton(x, slots, weights, w, _slot_pool(1, 32, 16, gen))  # the shared weight is missing
    with pytest.raises(ValueError, match="at most"):
        moe_decode(torch.zeros(129, 32), torch.zeros(129, 2, dtype=torch.long), torch.ones(129, 2), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_moe_decode_with_the_next_norm_is_the_two_launches_bitwise(dtype):
    """The sum with the next layer's input norm (one launch) equals the sum, then add_rms_norm."""
    from ft.kernels.norm.kernel import add_rms_norm_triton

    gen = torch.Generator().manual_seed(13)
    t, k, s, h, i = 3, 3, 5, 64, 32
    w, shared = _slot_pool(s, h, i, gen), _slot_pool(1, h, i, gen)
    slots, weights = _routing(t, k, s, 0.2, gen)
    weights = torch.cat([weights, torch.rand(t, 1, generator=gen)], dim=1).to(dtype)
    x = torch.randn(t, h, generator=gen).to(dtype)
    residual = torch.randn(t, h, generator=gen).to(dtype)
    norm_w = (torch.randn(h, generator=gen) * 0.1).to(dtype)
    x_next, h_next = moe_decode_triton(x, slots, weights, w, shared, residual=residual, norm_weight=norm_w, eps=1e-6)
    y = moe_decode_triton(x, slots, weights, w, shared)
    want_x, want_h = add_rms_norm_triton(y, residual, norm_w, 1e-6)
    assert torch.equal(h_next, want_h) and torch.equal(x_next, want_x)
    # the loop path (no fused sum) gives the pair through add_rms_norm too
    got = moe_decode_triton(x, slots, weights, w, shared, residual=residual, norm_weight=norm_w, eps=1e-6,
                            down_per_pair=False)
    assert isinstance(got, tuple) and got[0].shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_moe_decode_reads_slotless_experts_from_the_host_store(dtype):
    """Experts without a slot are read from the host store in place (no copy first): the result is
    bit for bit the one with every expert in a slot, and matches the slot-or-host reference."""
    gen = torch.Generator().manual_seed(21)
    layers, experts, t, k, h, i = 2, 6, 3, 3, 64, 32
    per_layer = [_slot_pool(experts, h, i, gen) for _ in range(layers)]
    host = SlotWeights(*(torch.stack(parts) for parts in zip(*per_layer)))  # [L, E, ...]
    shared = _slot_pool(1, h, i, gen)
    layer = 1
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    # only experts 1 and 4 of this layer have slots (0 and 1)
    table = torch.full((experts,), -1, dtype=torch.long)
    table[1], table[4] = 0, 1
    pool = SlotWeights(*(torch.stack([t_[layer][e] for e in (1, 4)]) for t_ in host))
    ids[0, 0], ids[1, 0] = 1, 4  # some pairs hit a slot ...
    ids[0, 1], ids[1, 1] = (2 if ids[0, 0] != 2 else 3), (5 if ids[1, 0] != 5 else 0)  # ... and some miss
    slots = table[ids]
    assert (slots < 0).any() and (slots >= 0).any()
    weights = torch.cat([torch.softmax(torch.randn(t, k, generator=gen), -1), torch.rand(t, 1, generator=gen)], 1)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights = weights.to(dtype)
    got = moe_decode_triton(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer)
    every = SlotWeights(*(p[layer] for p in host))  # every expert in slot = its id
    assert torch.equal(got, moe_decode_triton(x, ids, weights, every, shared))
    ref = moe_decode_ref(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < TOL[dtype]
    with pytest.raises(ValueError, match="topk_ids"):
        moe_decode_triton(x, slots, weights, pool, shared, host=host)


def _landing_case(dtype, dst_dtype, gen: torch.Generator, h: int = 64, i: int = 32):
    """A host store [2 layers, 6 experts], a pool of 6 slots (experts 1 and 4 of layer 1 in slots 0
    and 1, slots 2..5 free, holding other bytes), a routing with missed pairs and topk_dst naming a
    distinct free slot for each distinct missed expert but one (its pairs land nowhere), in a wider
    tensor (a row stride that is not k). A pair with a slot names slot 5: it must land nothing."""
    layers, experts, t, k = 2, 6, 4, 3
    host = SlotWeights(*(torch.stack(parts) for parts in zip(*[_slot_pool(experts, h, i, gen) for _ in range(layers)])))
    layer = 1
    free = _slot_pool(4, h, i, gen)
    pool = SlotWeights(*(torch.cat([torch.stack([t_[layer][e] for e in (1, 4)]), f]) for t_, f in zip(host, free)))
    table = torch.full((experts,), -1, dtype=torch.long)
    table[1], table[4] = 0, 1
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    ids[0] = torch.tensor([1, 0, 5])  # a hit and misses at least
    slots = table[ids]
    missed = sorted(set(ids[slots < 0].tolist()))
    assert len(missed) >= 2
    land = dict(zip(missed, (4, 2, 3)))  # a distinct free slot per missed expert ...
    if len(missed) <= 3:
        land.pop(missed[-1])  # ... but one, whose pairs land nowhere
    wide = torch.full((t, k + 2), -1, dtype=dst_dtype)
    dst = wide[:, 1 : k + 1]  # a row stride of k + 2
    for p in (slots < 0).nonzero().tolist():  # one pair per landed expert names its slot; the others -1
        e = int(ids[p[0], p[1]])
        if e in land and not (dst == land[e]).any():
            dst[p[0], p[1]] = land[e]
    dst[0, 0] = 5  # a hit (expert 1 in slot 0): only pairs read from the host store land
    assert dst.stride(0) == k + 2 and (dst >= 0).any() and ((dst < 0) & (slots < 0)).any()
    weights = torch.cat([torch.softmax(torch.randn(t, k, generator=gen), -1), torch.rand(t, 1, generator=gen)], 1)
    shared = _slot_pool(1, h, i, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    return x, slots, weights.to(dtype), pool, shared, host, ids, layer, dst


def _bytes(w: SlotWeights, s) -> list[torch.Tensor]:
    """The five tensors of slot s of a pool ([S, ...]) or of a host layer, as raw bytes."""
    return [t_[s].contiguous().view(torch.uint8) for t_ in w]


def _check_landed(pool: SlotWeights, before: SlotWeights, host: SlotWeights, ids, slots, dst, layer: int) -> None:
    """Each named dst slot holds exactly the host expert's bytes; every other slot is unchanged."""
    landed = {}
    for t_, j in ((slots < 0) & (dst >= 0)).nonzero().tolist():
        landed[int(dst[t_, j])] = int(ids[t_, j])
    assert landed
    layer_store = SlotWeights(*(t_[layer] for t_ in host))
    for s in range(pool.w13.shape[0]):
        want = _bytes(layer_store, landed[s]) if s in landed else _bytes(before, s)
        for got_t, want_t in zip(_bytes(pool, s), want):
            assert torch.equal(got_t, want_t), s


@pytest.mark.parametrize(("dtype", "dst_dtype", "down_config", "h", "i"),
                         [(torch.float16, torch.int32, (16, 0, 4), 64, 32), (torch.float32, torch.int64, None, 80, 48)],
                         ids=["fp16-int32-down16", "fp32-int64-two-tiles"])
def test_moe_decode_lands_host_experts_in_dst_slots(dtype, dst_dtype, down_config, h, i):
    """The read-through landing store: pairs read from the host store with a dst slot also write the
    bytes they read there. The output is bit for bit the one without it, each dst slot then holds
    the host expert exactly (all five tensors), and no other slot changes; also where a row's K is
    two whole-K tiles (H 80: 8 + 2 words, I 48: 4 + 2)."""
    gen = torch.Generator().manual_seed(31)
    x, slots, weights, pool, shared, host, ids, layer, dst = _landing_case(dtype, dst_dtype, gen, h, i)
    before = SlotWeights(*(t_.clone() for t_ in pool))
    want = moe_decode_triton(x, slots, weights, before, shared, host=host, topk_ids=ids, layer=layer,
                             down_config=down_config)
    got = moe_decode_triton(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer, topk_dst=dst,
                            down_config=down_config)
    assert torch.equal(got, want)
    _check_landed(pool, before, host, ids, slots, dst, layer)
    with pytest.raises(ValueError, match="host"):
        moe_decode_triton(x, slots, weights, pool, shared, topk_ids=ids, layer=layer, topk_dst=dst)
    with pytest.raises(ValueError, match="whole-K"):  # the K loop of gate/up cannot land rows
        moe_decode_triton(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer, topk_dst=dst,
                          gate_up_config=(8, 16, 4))


def test_moe_decode_ref_lands_host_experts_in_dst_slots():
    gen = torch.Generator().manual_seed(32)
    x, slots, weights, pool, shared, host, ids, layer, dst = _landing_case(torch.float32, torch.int64, gen)
    before = SlotWeights(*(t_.clone() for t_ in pool))
    want = moe_decode_ref(x, slots, weights, before, shared, host=host, topk_ids=ids, layer=layer)
    got = moe_decode_ref(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer, topk_dst=dst)
    assert torch.equal(got, want)
    _check_landed(pool, before, host, ids, slots, dst, layer)
    with pytest.raises(ValueError, match="host"):
        moe_decode_ref(x, slots, weights, pool, shared, topk_ids=ids, layer=layer, topk_dst=dst)


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "ref"])
def test_moe_decode_dispatcher_passes_the_host_store_and_dst(monkeypatch, triton_path):
    gen = torch.Generator().manual_seed(33)
    x, slots, weights, pool, shared, host, ids, layer, dst = _landing_case(torch.float32, torch.int64, gen)
    before = SlotWeights(*(t_.clone() for t_ in pool))
    if triton_path:
        monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    else:
        monkeypatch.delenv("FT_TRITON_INTERPRET_TEST", raising=False)
    import ft.kernels.moe.decode_kernel as details

    calls = []
    real = details.moe_decode_triton
    monkeypatch.setattr(details, "moe_decode_triton", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    got = moe_decode(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer, topk_dst=dst)
    assert bool(calls) == triton_path
    ref = moe_decode_ref(x, slots, weights, before, shared, host=host, topk_ids=ids, layer=layer)
    if triton_path:
        assert calls[0]["topk_dst"] is dst and calls[0]["host"] is host
        assert torch.equal(got, real(x, slots, weights, before, shared, host=host, topk_ids=ids, layer=layer))
    assert ((got - ref).norm() / ref.norm()).item() < TOL[torch.float32]
    _check_landed(pool, before, host, ids, slots, dst, layer)
    with pytest.raises(ValueError, match="host"):
        moe_decode(x, slots, weights, pool, shared, topk_ids=ids, layer=layer, topk_dst=dst)


@pytest.mark.parametrize("per_pair", [False, True], ids=["down-loop", "down-pairs"])
@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2], DECODE_CASES[4]], ids=str)
def test_moe_decode_skips_dead_tokens(case, per_pair):
    """`live` (a decode step's KV slot mapping): tokens with a negative entry (a graph's padding
    rows) give rows of zeros, in the kernels and the reference alike; the live tokens' rows are bit
    for bit the ones computed without `live` (one whole-K tile, two tiles, the K loop)."""
    t, k, s, h, i, dtype, skip, with_shared = case
    gen = torch.Generator().manual_seed(7 * t + h)
    w = _slot_pool(s, h, i, gen)
    shared = _slot_pool(1, h, i, gen) if with_shared else None
    slots, weights = _routing(t, k, s, skip, gen)
    weights = torch.cat([weights, torch.rand(t, 1, generator=gen)], dim=1) if with_shared else weights
    x = torch.randn(t, h, generator=gen).to(dtype)
    live = torch.arange(t, dtype=torch.int64) * 64
    live[1::2] = -1  # every other token is padding
    full = moe_decode_triton(x, slots, weights.to(dtype), w, shared, down_per_pair=per_pair)
    got = moe_decode_triton(x, slots, weights.to(dtype), w, shared, down_per_pair=per_pair,
                            out=torch.full((t, h), float("nan"), dtype=dtype), live=live)
    dead = live < 0
    assert torch.equal(got[~dead], full[~dead]) and not got[dead].any()
    ref = moe_decode_ref(x, slots, weights.to(dtype), w, shared, live=live.to(torch.int32))
    assert not ref[dead].any() and torch.equal(ref[~dead], moe_decode_ref(x, slots, weights.to(dtype), w, shared)[~dead])
    with pytest.raises(ValueError, match="live"):
        moe_decode_triton(x, slots, weights.to(dtype), w, shared, live=live[:-1])


def test_moe_decode_dead_token_still_lands_its_expert():
    """A dead token whose pair owns a landing (read-through: the first miss of an expert names its
    dst slot) still lands it, so the slot the book now names holds the expert; its row is zeros,
    the live rows as without `live`."""
    gen = torch.Generator().manual_seed(31)
    x, slots, weights, pool, shared, host, ids, layer, dst = _landing_case(torch.float32, torch.int64, gen)
    owners = sorted({tt for tt, _ in ((dst >= 0) & (slots < 0)).nonzero().tolist()})  # tokens that land an expert
    live = torch.zeros(x.shape[0], dtype=torch.int64)
    live[owners[0]] = -1  # a token that lands an expert is padding
    before = SlotWeights(*(t_.clone() for t_ in pool))
    want = moe_decode_triton(x, slots, weights, before, shared, host=host, topk_ids=ids, layer=layer)
    got = moe_decode_triton(x, slots, weights, pool, shared, host=host, topk_ids=ids, layer=layer, topk_dst=dst,
                            live=live)
    dead = live < 0
    assert torch.equal(got[~dead], want[~dead]) and not got[dead].any()
    _check_landed(pool, before, host, ids, slots, dst, layer)


def test_moe_decode_dispatcher_hands_live_to_the_kernel(monkeypatch):
    """`moe_decode` hands the step's `live` mapping on (its padding rows are skipped, not computed)."""
    from ft.kernels import moe as moe_mod

    seen = []
    monkeypatch.setattr(moe_mod, "moe_decode_ref", lambda *a, **kw: seen.append(kw.get("live")) or a[0])
    gen = torch.Generator().manual_seed(5)
    w = _slot_pool(3, 32, 16, gen)
    slots, weights = _routing(2, 2, 3, 0.0, gen)
    x, live = torch.randn(2, 32, generator=gen), torch.tensor([0, -1])
    monkeypatch.setattr(moe_mod, "runs_triton", lambda *a: False)
    moe_mod.moe_decode(x, slots, weights, w, live=live)
    assert seen == [live]


def test_the_down_rows_option_is_held_to_the_counters_sizing():
    """`MoeOptions.decode_down_rows` (or `decode_down_two_tiles`' rows, where the intermediate size is two whole-K
    tiles) under `DECODE_DOWN_MIN_BLOCK_H` (the sum counters' sizing) or not a power of two is refused, not
    rounded."""
    import ft.kernels.moe.decode_kernel as details
    from ft.kernels.moe import DECODE_DOWN_MIN_BLOCK_H

    for rows in (DECODE_DOWN_MIN_BLOCK_H // 2, 48):
        with use_kernel_options(variant(**{"moe.decode_down_rows": rows})):
            with pytest.raises(ValueError, match="decode_down_rows"):
                details.down_pairs_config()
    with use_kernel_options(variant(**{"moe.decode_down_two_tiles": (DECODE_DOWN_MIN_BLOCK_H // 2, 1)})):
        assert details.down_pairs_config(512)[0] == DEFAULTS.moe.decode_down_rows  # one tile: not this rule
        with pytest.raises(ValueError, match="decode_down_two_tiles"):
            details.down_pairs_config(640)  # two whole-K tiles (64 + 16 words)
    with use_kernel_options(variant(**{"moe.decode_down_rows": DECODE_DOWN_MIN_BLOCK_H})):
        assert details.down_pairs_config()[0] == DECODE_DOWN_MIN_BLOCK_H


def _spy_sum_launches(monkeypatch) -> list:
    """The grids of `moe_sum_pairs_kernel`'s launches from `decode_kernel` (the sum's own launch), as they come."""
    from ft.kernels.moe import decode_kernel

    sums = []
    real_sum = decode_kernel.moe_sum_pairs_kernel

    class Spy:
        def __getitem__(self, grid):
            sums.append(grid)
            return real_sum[grid]

    monkeypatch.setattr(decode_kernel, "moe_sum_pairs_kernel", Spy())
    return sums


@pytest.mark.parametrize("down_variant, case", [("down-16-rows", DECODE_CASES[2]), ("", DECODE_CASES[3])],
                         ids=["16-rows-variant", "two-tile-default"])
def test_narrow_down_tiles_sum_in_the_down_pass_with_the_counters_sized_for_them(monkeypatch, down_variant, case):
    """Counters sized by `sum_counters_needed` (at `DECODE_DOWN_MIN_BLOCK_H` rows) serve the narrower per-pair
    down tiles too, even when the options change after they were allocated: the pass sums the pairs itself
    (no sum kernel), the counters end zero, y matches the sum kernel's run under the same variant bit for bit."""
    from ft.kernels.moe import sum_counters_needed

    t, k, s, h, i, dtype, skip, with_shared = case
    gen = torch.Generator().manual_seed(77)
    w, shared = _slot_pool(s, h, i, gen), (_slot_pool(1, h, i, gen) if with_shared else None)
    slots, weights = _routing(t, k, s, skip, gen)
    weights = (torch.cat([weights, torch.rand(t, 1, generator=gen)], dim=1) if with_shared else weights).to(dtype)
    x = torch.randn(t, h, generator=gen).to(dtype)
    counters = torch.zeros(sum_counters_needed(t, h), dtype=torch.int32)
    sums = _spy_sum_launches(monkeypatch)
    with use_kernel_options(_options_named(down_variant)):
        want = moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True)
        assert len(sums) == 1
        got = moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True, sum_counters=counters)
    assert len(sums) == 1 and torch.equal(got, want) and not counters.any()
    ref = moe_decode_ref(x.float(), slots, weights.float(), w, shared)
    assert ((got.float() - ref).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2], DECODE_CASES[6]], ids=str)
def test_the_down_pass_sums_the_pairs_itself_bitwise(monkeypatch, case):
    """`sum_counters`: the per-pair down pass sums each token's pairs itself (the last of its programs of a
    column block): y bit for bit the sum kernel's, with and without padding tokens and with slotless pairs
    read from a host store, the sum kernel not launched, the counters zero after each call (twice on the
    same counters); with too few counters, or variant "moe-sum-own-launch", the sum kernel runs."""
    from ft.kernels.moe import sum_counters_needed

    t, k, s, h, i, dtype, skip, with_shared = case
    gen = torch.Generator().manual_seed(3 * t + h + i)
    w = _slot_pool(s, h, i, gen)
    shared = _slot_pool(1, h, i, gen) if with_shared else None
    slots, weights = _routing(t, k, s, skip, gen)
    weights = (torch.cat([weights, torch.rand(t, 1, generator=gen)], dim=1) if with_shared else weights).to(dtype)
    x = torch.randn(t, h, generator=gen).to(dtype)
    live = torch.arange(t, dtype=torch.int64)
    live[1::2] = -1
    counters = torch.zeros(sum_counters_needed(t, h), dtype=torch.int32)
    sums = _spy_sum_launches(monkeypatch)
    for live_ in (None, live):
        want = moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True, live=live_)
        assert len(sums) == 1
        sums.clear()
        for _ in range(2):
            got = moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True, live=live_,
                                    out=torch.full((t, h), float("nan"), dtype=dtype), sum_counters=counters)
            assert torch.equal(got, want) and not sums and not counters.any()
    # slotless pairs read from a host store (the read-through path) sum alike
    host = SlotWeights(*(p[None] for p in w))  # one layer whose expert e is slot e
    no_slots = torch.where(slots >= 0, -1, slots)
    ids = slots.clamp(min=0).to(torch.int64)
    got = moe_decode_triton(x, no_slots, weights, w, shared, host=host, topk_ids=ids, layer=0, sum_counters=counters)
    assert torch.equal(got, moe_decode_triton(x, no_slots, weights, w, shared, host=host, topk_ids=ids, layer=0))
    assert not counters.any()
    sums.clear()
    moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True, sum_counters=counters[: t * ((h + 63) // 64) - 1])
    with use_kernel_options(variant("moe-sum-own-launch")):
        moe_decode_triton(x, slots, weights, w, shared, down_per_pair=True, sum_counters=counters)
    assert len(sums) == 2
