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

