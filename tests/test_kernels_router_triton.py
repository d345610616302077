"""Triton MoE router (softmax, top-k, renormalization) against `router_topk_ref`, under the interpreter;
the debug-mode slot checks of the MoE dispatcher and layer."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.model.layers.moe import SparseMoE
from ft.kernels.moe import check_slots
from ft.kernels.router import router_topk, router_topk_ref
from ft.kernels.router.kernel import router_topk_triton

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("t", "e", "k", "normalize"), [(3, 8, 2, True), (5, 20, 3, False), (2, 512, 10, True), (1, 4, 4, False)])
def test_router_matches_ref(t, e, k, normalize, dtype):
    gen = torch.Generator().manual_seed(t * 1000 + e * 10 + k)
    logits = (torch.randn(t, e, generator=gen) * 2).to(dtype)
    w, ids = router_topk_triton(logits, k, normalize)
    w_ref, ids_ref = router_topk_ref(logits, k, normalize)
    assert w.dtype == dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (t, k)
    probs = torch.softmax(logits.float(), dim=-1)
    # the same experts in the same order, up to ties (bf16 logits tie often; ties go to the lowest id here)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref))
    assert len(set(ids.flatten().tolist())) > 0 and all(len(set(r)) == k for r in ids.tolist())
    assert ((w.float() - w_ref.float()).abs().max() / w_ref.float().abs().max()).item() < TOL[dtype]


def test_router_dispatcher_and_bad_k(monkeypatch):
    logits = torch.randn(4, 16)
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    import ft.kernels.router.kernel as details

    calls = []
    real = details.router_topk_triton
    monkeypatch.setattr(details, "router_topk_triton", lambda *a: calls.append(1) or real(*a))
    w, ids = router_topk(logits, 3, True)
    assert calls and torch.equal(ids, router_topk_ref(logits, 3, True)[1])
    with pytest.raises(ValueError):
        router_topk_triton(logits, 17, True)


def test_check_slots():
    check_slots(torch.tensor([[0, -1], [3, 2]]), 4)
    with pytest.raises(ValueError, match="slot 4"):
        check_slots(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="slot -2"):
        check_slots(torch.tensor([[-2, 1]]), 4)


def test_missing_expert_slot_is_an_error_in_debug_mode(monkeypatch):
    layer = SparseMoE.__new__(SparseMoE)
    layer.moe_index = 3
    table = torch.tensor([0, -1, 1, -1])
    ids = torch.tensor([[0, 1], [2, 0]])
    monkeypatch.delenv("FT_DEBUG", raising=False)
    assert layer._slots(table, ids).tolist() == [[0, -1], [1, 0]]  # not checked: the kernels would skip it
    monkeypatch.setenv("FT_DEBUG", "1")
    with pytest.raises(RuntimeError, match=r"MoE layer 3: experts \[1\] have no slot"):
        layer._slots(table, ids)
    assert layer._slots(table, torch.tensor([[0, 2]])).tolist() == [[0, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("shared_gate", "with_table"), [(True, True), (True, False), (False, True)])
def test_route_matches_ref(dtype, shared_gate, with_table):
    from ft.kernels.router import route_ref
    from ft.kernels.router.kernel import route_triton

    gen = torch.Generator().manual_seed(7)
    t, e, k = 5, 64, 6
    logits = (torch.randn(t, e + shared_gate, generator=gen) * 2).to(dtype)
    table = torch.randperm(e, generator=gen) if with_table else None
    if table is not None:
        table[::5] = -1  # experts without a slot
    w, ids, slots = route_triton(logits, k, True, shared_gate=shared_gate, slot_table=table)
    w_ref, ids_ref, slots_ref = route_ref(logits, k, True, shared_gate=shared_gate, slot_table=table)
    assert w.shape == (t, k + shared_gate) and w.dtype == dtype
    probs = torch.softmax(logits[:, :e].float(), dim=-1)  # the same experts up to ties (bf16 ties often)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref))
    assert ((w.float() - w_ref.float()).abs().max()).item() < TOL[dtype]
    if shared_gate:  # the shared weight is the sigmoid of the last column, not part of the softmax
        assert torch.allclose(w[:, k].float(), torch.sigmoid(logits[:, e].float()), atol=TOL[dtype])
        assert torch.allclose(w[:, :k].float().sum(dim=1), torch.ones(t), atol=TOL[dtype] * k)
    if with_table:
        assert slots.dtype == torch.int32 and slots_ref.dtype == torch.int32 and (slots == table[ids]).all()
    else:
        assert slots is None and slots_ref is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("normalize", [True, False])
def test_forced_route_matches_the_reference(dtype, normalize):
    """Experts given (synthetic traces): the kernel's weights are the softmax at them, as the
    reference's; the ids are the given ones, the shared gate's weight and the slots follow."""
    from ft.kernels.router import route_forced_ref
    from ft.kernels.router.kernel import route_triton

    gen = torch.Generator().manual_seed(5)
    t, e, k = 3, 40, 4
    logits = (torch.randn(t, e + 1, generator=gen) * 2).to(dtype)
    forced = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    layers = torch.stack([forced, forced.flip(1)], dim=1)  # [T, layers, k]: the engine passes a strided view
    table = torch.randint(-1, 16, (e,), generator=gen)
    w, ids, slots = route_triton(logits, k, normalize, shared_gate=True, slot_table=table, forced=layers[:, 0])
    w_ref, ids_ref, slots_ref = route_forced_ref(logits, forced, normalize, shared_gate=True, slot_table=table)
    assert torch.equal(ids, forced) and torch.equal(slots, slots_ref)
    assert ((w.float() - w_ref.float()).abs().max() / w_ref.float().abs().max()).item() < TOL[dtype]
    with pytest.raises(ValueError, match="forced"):
        route_triton(logits, k + 1, normalize, shared_gate=True, forced=forced)


ROUTE_HIDDEN = [(1, 64, 48, 6, True, False), (3, 37, 80, 4, False, False), (8, 512, 64, 10, True, False),
                (16, 20, 1040, 3, True, False), (5, 64, 48, 6, True, True), (13, 37, 80, 4, False, True)]
"""(tokens, experts, hidden width, k, renormalise, forced experts): 16 tokens take two token blocks (two
counters), a hidden width of 1,040 in fp32 the GEMV's K loop with a masked last tile, 37 experts no
power of two."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("t", "e", "h", "k", "normalize", "forced"), ROUTE_HIDDEN,
                         ids=[f"T{t}-E{e}-H{h}-k{k}{'-forced' if f else ''}" for t, e, h, k, _, f in ROUTE_HIDDEN])
def test_routing_from_the_hidden_state_in_one_launch_equals_the_two(monkeypatch, t, e, h, k, normalize, forced,
                                                                    dtype):
    """`route_hidden_triton` (the router's GEMV and the routing in one launch, the last program of a token
    block routing it) against the two-launch path it replaces, `route(dense_linear(x, w))`: the same
    experts and slots, the weights (the shared gate's last) to fp32 rounding; the counters are zero
    after every call, and a second call on them gives the same result."""
    from ft.kernels.dense import dense_linear
    from ft.kernels.router import ROUTE_COUNTERS, route, route_hidden
    from ft.kernels.router.hidden_kernel import route_hidden_triton

    gen = torch.Generator().manual_seed(t * 100 + e + h)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w = (torch.randn(e + 1, h, generator=gen) * h ** -0.5 * 3).to(dtype)
    table = torch.randperm(e, generator=gen).to(torch.int32) - 3  # some experts without a slot (-1 .. -3)
    ids_in = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if forced else None
    counters = torch.zeros(ROUTE_COUNTERS, dtype=torch.int32)
    got = route_hidden_triton(x, w, k, normalize, counters, shared_gate=True, slot_table=table, forced=ids_in)
    want = route(dense_linear(x, w), k, normalize, shared_gate=True, slot_table=table, forced=ids_in)
    assert not counters.any()
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[0].dtype == dtype and got[0].shape == (t, k + 1)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=TOL[dtype], atol=TOL[dtype])
    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")  # the dispatcher takes the kernel on the CPU
    again = route_hidden(x, w, k, normalize, counters=counters, shared_gate=True, slot_table=table, forced=ids_in)
    assert all(torch.equal(a, b) for a, b in zip(again, got)) and not counters.any()


def test_the_moe_layer_routes_its_decode_step_in_one_launch(monkeypatch):
    """A `SparseMoE` decode step (the Triton path in the interpreter) routes through `route_hidden_triton`
    with its own counters, and picks the experts (and weights) of the reference routing."""
    from ft.kernels.router import hidden_kernel

    monkeypatch.setenv("FT_TRITON_INTERPRET_TEST", "1")
    calls = []
    real = hidden_kernel.route_hidden_triton
    monkeypatch.setattr(hidden_kernel, "route_hidden_triton", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    from ft.model.layers.linear import Linear

    gen = torch.Generator().manual_seed(5)
    h, e = 32, 16
    from ft.model.layers.moe import MLP

    shared = MLP(*(Linear(torch.randn(8, h, generator=gen)) for _ in range(2)), Linear(torch.randn(h, 8, generator=gen)))
    moe = SparseMoE(Linear(torch.randn(e, h, generator=gen)), shared, Linear(torch.randn(1, h, generator=gen)), 4, True,
                    0)
    x = torch.randn(3, h, generator=gen)
    weights, ids, slots = moe._route(x, None, None)
    assert len(calls) == 1 and calls[0] is moe.route_counters and slots is None
    from ft.kernels.router import route_ref

    want = route_ref(torch.cat([x @ moe.router.weight.T, x @ moe.shared_expert_gate.weight.T], 1), 4, True,
                     shared_gate=True)
    assert torch.equal(ids, want[1]) and torch.allclose(weights, want[0], atol=1e-6)
    from ft.kernels.options import use_kernel_options, variant

    with use_kernel_options(variant("moe-route-two-launches")):  # the GEMV, then the top-k kernel
        two = moe._route(x, None, None)
    assert len(calls) == 1 and torch.equal(two[1], ids) and torch.allclose(two[0], weights, atol=1e-6)
