"""The expert lookup of offloaded decode (slots, use bookkeeping, landing claims): the Triton
kernel under the interpreter against the reference, and the reference's contract."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.expert_lookup import commit_landed, commit_landed_ref, expert_lookup, expert_lookup_ref, new_book
from ft.kernels.expert_lookup.kernel import commit_landed_triton, expert_lookup_owned_triton, expert_lookup_triton


def _setup(layers=3, experts=16, cap=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.full((layers, experts), -1, dtype=torch.int64)
    for layer in range(layers):  # a few residents per layer
        table[layer, torch.randperm(experts, generator=gen)[:5]] = torch.arange(5) + 5 * layer
    book = new_book(layers, experts, cap, torch.device("cpu"))
    book.landing[1, :3] = torch.tensor([40, 41, 42], dtype=torch.int32)  # layer 1: three landing slots
    return gen, table, book


def _ids(gen, t, k, experts):
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])


def test_reference_contract():
    gen, table, book = _setup()
    ids = torch.tensor([[0, 1, 2], [2, 3, 0], [1, 2, 4]])  # rows 0..1 real, row 2 padding
    table[1] = -1
    table[1, 1] = 7
    book.step[0], book.step[1] = 5, 2
    slots, dst = expert_lookup_ref(ids, table, book, 1)
    assert slots.tolist() == [[-1, 7, -1], [-1, -1, -1], [7, -1, -1]]
    # misses claim in row order: 0 -> 40, 2 -> 41 (row 0); 3 -> 42 (row 1); the rest got nothing
    assert dst.tolist() == [[40, -1, 41], [-1, 42, -1], [-1, -1, -1]]
    assert book.landed[1, :3].tolist() == [0, 2, 3] and int(book.landing_used[1]) == 3
    assert book.last_use[1, :5].tolist() == [5, 5, 5, 5, -1]  # row 2 (padding) is not counted
    assert book.counters[1].tolist() == [1, 5]
    assert book.claim[1, :5].tolist() == [5, -1, 5, 5, -1]
    # a second step: the claims are new again; landing slots beyond those reserved land nowhere
    book.step[0] = 6
    book.landing_used.zero_()
    book.landing[1] = -1
    book.landing[1, 0] = 43
    slots, dst = expert_lookup_ref(ids, table, book, 1)
    assert dst.tolist() == [[43, -1, -1], [-1, -1, -1], [-1, -1, -1]] and int(book.landing_used[1]) == 3


@pytest.mark.parametrize(("t", "k", "real"), [(1, 4, 1), (4, 3, 4), (8, 5, 6), (3, 16, 3)])
def test_kernel_matches_reference(t, k, real):
    gen, table, book = _setup(experts=32, cap=6, seed=t * 10 + k)
    book.landing[1, :5] = torch.tensor([50, 51, -1, 53, 54], dtype=torch.int32)  # a hole: that claim lands nowhere
    ref_book = type(book)(*(x.clone() for x in book))
    for step in range(3):
        ids = _ids(gen, t, k, 32)
        for b in (book, ref_book):
            b.step[0], b.step[1] = step, real
            b.landing_used.zero_()
        got = expert_lookup_triton(ids, table, book, 1)
        want = expert_lookup_ref(ids, table, ref_book, 1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for name, a, b in zip(book._fields, book, ref_book):
            assert torch.equal(a, b), name
    # only layer 1's rows changed
    fresh = new_book(3, 32, 6, torch.device("cpu"))
    assert torch.equal(book.last_use[0], fresh.last_use[0]) and torch.equal(book.counters[2], fresh.counters[2])


def test_dispatcher_runs_the_kernel_in_interpreter_tests(monkeypatch):
    gen, table, book = _setup()
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.expert_lookup.kernel as details

    calls = []
    real = details.expert_lookup_triton
    monkeypatch.setattr(details, "expert_lookup_triton", lambda *a: calls.append(1) or real(*a))
    book.step[1] = 2
    slots, dst = expert_lookup(_ids(gen, 2, 3, 16), table, book, 0)
    assert calls and slots.dtype == dst.dtype == torch.int32


def test_commit_maps_what_the_step_landed():
    """After a step's lookups: each claimed, reserved landing slot holds its expert in the table;
    the claim that found a hole and the claims past the reserve map nothing; other layers untouched."""
    gen, table, book = _setup(experts=16, cap=4)
    table[1] = -1
    book.landing[1] = torch.tensor([40, -1, 42, 43], dtype=torch.int32)
    book.step[0], book.step[1] = 1, 2
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    expert_lookup_ref(ids, table, book, 1)  # 6 misses claim in order: 0->40, 1->hole, 2->42, 3->43, 4, 5 past R
    assert int(book.landing_used[1]) == 6
    before = table.clone()
    commit_landed_ref(table, book)
    want = torch.full((16,), -1, dtype=torch.int64)
    want[0], want[2], want[3] = 40, 42, 43
    assert torch.equal(table[1], want)
    assert torch.equal(table[0], before[0]) and torch.equal(table[2], before[2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commit_kernel_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    layers, experts, cap = 5, 64, 8
    book = new_book(layers, experts, cap, torch.device("cpu"))
    book.landing.copy_(torch.randint(-1, 200, (layers, cap), generator=gen, dtype=torch.int32))
    book.landing_used.copy_(torch.randint(0, cap + 3, (layers,), generator=gen, dtype=torch.int32))
    book.landed.copy_(torch.stack([torch.randperm(experts, generator=gen)[:cap] for _ in range(layers)]).int())
    table = torch.randint(-1, 300, (layers, experts), generator=gen)
    want = table.clone()
    commit_landed_ref(want, book)
    got = table.clone()
    commit_landed_triton(got, book)
    assert torch.equal(got, want) and not torch.equal(want, table)
    got2 = table.clone()
    commit_landed(got2, book)  # the dispatcher (the reference here, without FT_TRITON_INTERPRET_TEST)
    assert torch.equal(got2, want)


def test_reference_contract_with_owners():
    """Landing slots that still hold their victims (`book.owner`): a victim some real row routed this
    step in this layer or a layer before stays (pinned, a hit); the others are claimed in order, and
    the claim unmaps the victim, also one of a later layer (which then misses it)."""
    layers, experts = 3, 16
    table = torch.full((layers, experts), -1, dtype=torch.int64)
    table[1, 1], table[1, 3], table[2, 5], table[0, 4] = 7, 9, 20, 30
    book = new_book(layers, experts, 4, torch.device("cpu"))
    book.landing[1] = torch.tensor([7, 9, 20, 30], dtype=torch.int32)
    book.owner[1] = torch.tensor([1 * experts + 1, 1 * experts + 3, 2 * experts + 5, 0 * experts + 4],
                                 dtype=torch.int32)
    book.step[0], book.step[1] = 5, 1
    book.last_use[0, 4] = 5  # layer 0 (looked up before this one) used expert 4 this step
    ids = torch.tensor([[1, 10, 11], [3, 12, 13]])  # row 1 is padding: its use of expert 3 pins nothing
    slots, dst = expert_lookup_ref(ids, table, book, 1)
    assert slots.tolist() == [[7, -1, -1], [9, -1, -1]]
    assert dst.tolist() == [[-1, 9, 20], [-1, -1, -1]]  # slots 7 (routed here) and 30 (layer 0) are pinned
    assert book.landed[1].tolist() == [-1, 10, 11, -1] and int(book.landing_used[1]) == 2
    assert int(table[1, 3]) == int(table[2, 5]) == -1  # the claimed victims are unmapped at once
    assert int(table[1, 1]) == 7 and int(table[0, 4]) == 30
    slots2, _ = expert_lookup_ref(torch.tensor([[5, 6, 7]]), table, book, 2)
    assert int(slots2[0, 0]) == -1  # the later layer's victim is a miss now, not a read of a reused slot
    commit_landed_ref(table, book)
    assert int(table[1, 10]) == 9 and int(table[1, 11]) == 20


def _owned_setup(seed, layers=3, experts=32, cap=8):
    """Residents in every layer; layer 1's landing slots: some free, some held by victims of any layer."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.full((layers, experts), -1, dtype=torch.int64)
    for layer in range(layers):
        table[layer, torch.randperm(experts, generator=gen)[:12]] = torch.arange(12) + 12 * layer
    book = new_book(layers, experts, cap, torch.device("cpu"))
    flat = (table.view(-1) >= 0).nonzero().flatten()
    victims = flat[torch.randperm(len(flat), generator=gen)[: cap // 2]]
    book.landing[1, : cap // 2] = table.view(-1)[victims].int()
    book.owner[1, : cap // 2] = victims.int()
    book.landing[1, cap // 2: cap - 1] = torch.arange(cap // 2 - 1, dtype=torch.int32) + 100  # free ones, a hole last
    return gen, table, book


@pytest.mark.parametrize(("t", "k", "real"), [(1, 4, 1), (4, 3, 4), (8, 5, 6), (3, 16, 3), (6, 10, 2)])
def test_owned_kernel_matches_reference(t, k, real):
    """The one-program kernel (`expert_lookup_owned_triton`) against the reference: slots, landing
    slots, every book field but its scratch, and the table (victims unmapped), over steps where
    earlier layers stamped some victims and rows share experts."""
    for seed in range(3):
        gen, table, book = _owned_setup(seed * 100 + t * 10 + k)
        for step in range(2):
            ref_table, ref_book = table.clone(), type(book)(*(x.clone() for x in book))
            ids = _ids(gen, t, k, 32)
            if t > 1:
                ids[1, 0] = ids[0, 1]  # an expert two rows share
            for b in (book, ref_book):
                b.step[0], b.step[1] = step + 1, real
                b.landing_used.zero_()
                b.landed.fill_(-1)
                b.last_use[0, :16] = step + 1  # layer 0 ran before: half its experts used this step
            got = expert_lookup_owned_triton(ids, table, book, 1)
            want = expert_lookup_ref(ids, ref_table, ref_book, 1)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, step)
            for name, a, b in zip(book._fields, book, ref_book):
                if name != "order":
                    assert torch.equal(a, b), (name, seed, step)
            assert torch.equal(table, ref_table)
        assert int((book.landed >= 0).sum()) > 0


def test_dispatcher_takes_the_owned_kernel_for_owners(monkeypatch):
    gen, table, book = _owned_setup(0)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.expert_lookup.kernel as details

    calls = []
    real = details.expert_lookup_owned_triton
    monkeypatch.setattr(details, "expert_lookup_owned_triton", lambda *a: calls.append(1) or real(*a))
    book.step[1] = 2
    expert_lookup(_ids(gen, 2, 3, 32), table, book, 1, owners=True)
    assert calls


@pytest.mark.parametrize(("k", "shared_gate", "forced"), [(4, True, False), (10, True, False), (3, False, False),
                                                          (5, True, True)])
def test_fused_route_and_lookup_matches_the_two_references(k, shared_gate, forced):
    """One token's routing and owned lookup in one program (`route_lookup_owned_triton`) against
    `route_ref` / `route_forced_ref` then `expert_lookup_ref`: weights, ids, slots, landing slots, every
    book field but its scratch, and the table (claimed victims unmapped), over steps where an earlier
    layer stamped some victims."""
    from ft.kernels.expert_lookup.kernel import route_lookup_owned_triton
    from ft.kernels.router import route_forced_ref, route_ref

    experts, landings = 32, 0
    for seed in range(3):
        gen, table, book = _owned_setup(seed * 10 + k)
        for step in range(3):
            ref_table, ref_book = table.clone(), type(book)(*(x.clone() for x in book))
            logits = torch.randn(1, experts + int(shared_gate), generator=gen, dtype=torch.float32)
            ids_in = _ids(gen, 1, k, experts) if forced else None
            for b in (book, ref_book):
                b.step[0], b.step[1] = step + 1, 1
                b.landing_used.zero_()
                b.landed.fill_(-1)
                b.last_use[0, :16] = step + 1  # layer 0 ran before: half its experts used this step
            w, ids, slots, dst = route_lookup_owned_triton(logits, k, True, table, book, 1, shared_gate=shared_gate,
                                                           forced=ids_in)
            if forced:
                w_ref, ids_ref, _ = route_forced_ref(logits, ids_in, True, shared_gate=shared_gate)
            else:
                w_ref, ids_ref, _ = route_ref(logits, k, True, shared_gate=shared_gate)
            slots_ref, dst_ref = expert_lookup_ref(ids_ref, ref_table, ref_book, 1)
            assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6), (seed, step)
            assert torch.equal(slots, slots_ref) and torch.equal(dst, dst_ref), (seed, step)
            for name, a, b in zip(book._fields, book, ref_book):
                if name != "order":
                    assert torch.equal(a, b), (name, seed, step)
            assert torch.equal(table, ref_table)
            landings += int((book.landed >= 0).sum())
    assert landings > 0


def test_route_and_lookup_fuses_one_token_with_owners_only(monkeypatch):
    """The dispatcher: one token with owners takes the fused launch (the default; the variant
    "route-lookup-apart" turns it off); more tokens, or no owners, the two launches; the fused and the two
    give the same."""
    from ft.kernels.expert_lookup import route_and_lookup
    from ft.kernels.options import use_kernel_options, variant

    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.expert_lookup.kernel as details

    calls = []
    real = details.route_lookup_owned_triton
    monkeypatch.setattr(details, "route_lookup_owned_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = []
    apart = "route-lookup-apart"
    for owners, t, name in ((True, 1, None), (True, 1, apart), (True, 2, None), (False, 1, None)):
        gen, table, book = _owned_setup(3)
        if not owners:
            book.owner.fill_(-1)
        book.step[0], book.step[1] = 1, t
        logits = torch.randn(t, 33, generator=torch.Generator().manual_seed(5))
        before = len(calls)
        with use_kernel_options(variant(*([name] if name else []))):
            out = route_and_lookup(logits, 4, True, table, book, 1, owners=owners, shared_gate=True)
        assert (len(calls) > before) == (owners and t == 1 and name is None)
        results.append((out, book, table))
    (a, book_a, table_a), (b, book_b, table_b) = results[:2]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(table_a, table_b)
    assert all(torch.equal(x, y) for name, x, y in zip(book_a._fields, book_a, book_b) if name != "order")
