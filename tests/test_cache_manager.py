"""The cache manager's promises: the plan's bytes are the allocator's bytes (on every storage
backend), every advertised size is reachable and the rest is refused untouched, and faults in a
step, in the middle of a multi-tensor pool, or in an inverse never leave a stale geometry."""

from __future__ import annotations

import ctypes
import mmap

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ft.engine import LLM, SamplingParams
from ft.errors import InjectedFault, RebuildFailed, RebuildRefused
from ft.memory import host_reservation
from test_oracle import hf_greedy, prompt_of
from test_rebuild import geometry_of

POOLS = ("moe", "kv", "mamba")


def _llm(path, backend: str, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", page_size=16, num_tokens=512, moe_cache_size=6, mamba_cache_size=6,
                max_running_requests=3, storage_backend=backend)
    return LLM(model=str(path), **{**opts, **kw})


@pytest.fixture(scope="module", params=["mmap", "realloc"])
def backend_llm(request, tiny_one):
    _, model, path = tiny_one
    # a budget the boot geometry nearly fills, so that the transient of a reallocation matters
    llm = _llm(path, request.param, cache_budget=1_200_000)
    return llm, model


def _measured(e):
    """Record the bytes the allocator holds after every executed step."""
    held: list[int] = []
    e.cache.rebuilder.observer = lambda name: held.append(e.cache.storage.held_bytes())
    return held


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(moves=st.lists(st.tuples(st.sampled_from(POOLS + ("all",)), st.floats(0, 1), st.booleans()),
                      min_size=1, max_size=4))
def test_allocator_bytes_never_exceed_the_plan_and_the_plan_fits(backend_llm, moves):
    llm, model = backend_llm
    e = llm.engine
    lay, budget = e.cache.layout, e.cache.budget.budget_bytes
    prompt = prompt_of(40, seed=5)
    seq = e.add_request(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    e.step()
    for which, frac, inside in moves:
        g, ranges = e.cache.geometry, e.cache.reachable_ranges()
        pools = POOLS if which == "all" else (which,)
        want = {}
        for p in pools:
            lo, hi = ranges[p]
            unit = e.config.page_size if p == "kv" else 1
            if inside and hi >= lo:
                want[p] = lay.round_size(p, lo + int(frac * (hi - lo)) // unit * unit)
            else:
                want[p] = hi + unit
        plan = e.cache.plan_resize(**want)
        if len(pools) == 1 and inside and ranges[pools[0]][1] >= ranges[pools[0]][0]:
            assert plan.fits and plan.peak_bytes <= budget  # advertised: reachable
        if not plan.fits:
            held = e.cache.storage.held_bytes()
            with pytest.raises(RebuildRefused):
                e.cache.rebuild(**want)
            assert e.cache.geometry == g and e.cache.storage.held_bytes() == held  # untouched
            continue
        steps = _measured(e)
        e.cache.rebuild(**want)
        assert all(b <= plan.peak_bytes for b in steps), (steps, plan)
        if plan.steps:
            assert e.cache.rebuilder.measured_peak_bytes <= plan.peak_bytes <= budget
        assert e.cache.storage.held_bytes() == lay.nbytes(e.cache.geometry) and geometry_of(e) == e.cache.geometry
        e.step()
    e.run_until_done([seq])
    want_ids = hf_greedy(model, prompt, 12)
    assert seq.output_ids == want_ids[: len(seq.output_ids)]
    assert seq.finish_reason == "length" or "KV cache" in (seq.error or "")


def test_realloc_ranges_count_the_copy(tiny_one):
    """A reallocating backend holds a tensor's old and new allocation while it copies: its plan
    says so, and a target that only fits without that transient is refused."""
    _, _, path = tiny_one
    mm, re = _llm(path, "mmap", cache_budget=1_200_000).engine, _llm(path, "realloc", cache_budget=1_200_000).engine
    assert mm.cache.geometry == re.cache.geometry
    p_mm, p_re = mm.cache.plan_resize(kv=256), re.cache.plan_resize(kv=256)
    assert p_re.peak_bytes > p_mm.peak_bytes == mm.cache.layout.nbytes(mm.cache.geometry)
    assert re.cache.reachable_ranges()["kv"][1] < mm.cache.reachable_ranges()["kv"][1]
    assert re.describe()["storage"]["backend"] == "realloc" and re.describe()["storage"]["reallocates"]


@pytest.mark.skipif(not host_reservation.available(), reason="mmap reservations need Linux")
def test_mmap_shrink_returns_pages_to_the_kernel():
    """Resident pages of a reservation (mincore, the kernel's own count) follow the committed size."""
    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    r = host_reservation.HostReservation(64 * mmap.PAGESIZE)

    def resident() -> int:
        vec = (ctypes.c_ubyte * 64)()
        assert libc.mincore(ctypes.c_void_p(r.ptr), ctypes.c_size_t(64 * mmap.PAGESIZE), vec) == 0
        return sum(v & 1 for v in vec)

    r.resize(40 * mmap.PAGESIZE)
    r.tensor(torch.uint8, (40 * mmap.PAGESIZE,)).fill_(7)
    assert resident() == 40
    r.resize(10 * mmap.PAGESIZE)
    assert resident() == 10
    r.resize(20 * mmap.PAGESIZE)
    t = r.tensor(torch.uint8, (20, mmap.PAGESIZE))
    assert int(t[:10].min()) == 7 and int(t[10:].max()) == 0  # kept rows kept, regrown rows are fresh


# ------------------------------------------------------------------------------- faults


@pytest.fixture()
def busy(tiny_one):
    """An engine with a request in flight and a prefix entry."""
    _, model, path = tiny_one
    llm = _llm(path, "mmap")
    e = llm.engine
    llm.generate(prompt_token_ids=[prompt_of(30, seed=20)], max_new_tokens=4, temperature=0.0)
    prompt = prompt_of(25, seed=21)
    seq = e.add_request(prompt, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    e.step()
    return e, seq, hf_greedy(model, prompt, 16)


def _fail_at(label: str):
    def fault(name: str) -> None:
        if name == label:
            raise InjectedFault(f"fault injected in {label}")
    return fault


@pytest.mark.parametrize("label", ["mamba[1]", "moe[1]"])
def test_fault_inside_a_multi_tensor_pool_changes_none_of_it(busy, label):
    e, seq, want = busy
    g = e.cache.geometry
    e.cache.storage.fault = _fail_at(label)
    with pytest.raises(RebuildFailed, match="InjectedFault"):
        e.cache.rebuild(moe=10, mamba=8)
    e.cache.storage.fault = None
    assert e.cache.geometry == g == geometry_of(e) and e.cache.degraded is None
    assert e.cache.history[-1]["status"] == "rolled_back"
    e.run_until_done([seq])
    assert seq.output_ids == want


def test_failing_inverse_reports_degraded_never_a_stale_geometry(busy):
    e, seq, want = busy
    e.cache.rebuilder.fault_at = "grow moe"
    e.cache.rebuilder.fault_in_undo = "shrink kv"
    with pytest.raises(RebuildFailed, match="the rollback did not complete"):
        e.cache.rebuild(moe=10, kv=256)
    e.cache.rebuilder.fault_at = e.cache.rebuilder.fault_in_undo = None
    assert e.cache.degraded and "shrink kv" in e.cache.degraded
    assert e.cache.geometry == geometry_of(e) and e.cache.geometry.kv_tokens == 256  # what the pools hold
    assert e.cache.history[-1]["status"] == "degraded" and e.describe()["degraded"] == e.cache.degraded
    from ft.engine.core.admin import history

    assert history(e).entries[0].status == "degraded"  # (newest first; the admin API's schema takes it: `ft ctl history`)
    e.run_until_done([seq])
    assert seq.output_ids == want
    e.cache.rebuild(kv=512)  # a successful rebuild makes every pool whole again
    assert e.cache.degraded is None


def test_inverse_failing_inside_a_pool_narrows_it_consistently(busy):
    e, seq, want = busy
    faults = {"mamba[1]", "undo mamba[0]"}

    def fault(name: str) -> None:
        if name in faults:
            raise InjectedFault(name)

    e.cache.storage.fault = fault
    with pytest.raises(RebuildFailed):
        e.cache.rebuild(mamba=9)
    e.cache.storage.fault = None
    assert e.cache.degraded and "mamba" in e.cache.degraded
    assert e.cache.geometry == geometry_of(e) and e.cache.geometry.mamba_slots == 6  # narrowed to what both hold
    e.run_until_done([seq])
    assert seq.output_ids == want


def test_degraded_state_is_reported_by_health_admin_and_ctl(tiny_one):
    """A failed rollback shows in /health, GET /admin/cache and `ft ctl cache`; the server serves on."""
    from fastapi.testclient import TestClient

    from ft.ctl.format import format_cache
    from ft.schemas import CacheState
    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop

    _, _, path = tiny_one
    loop = EngineLoop(lambda: _llm(path, "realloc").engine)
    with TestClient(create_app(ServerState(loop, "tiny"))) as client:
        loop.ready.wait(60)
        assert client.get("/health").json() == {"status": "ok"}
        state = CacheState.model_validate(client.get("/admin/cache").json())
        assert state.storage.backend == "realloc" and state.storage.reallocates and state.degraded is None
        assert "storage realloc: a resize copies" in format_cache(state)

        def break_it(e):
            e.cache.rebuilder.fault_at, e.cache.rebuilder.fault_in_undo = "grow moe", "shrink kv"
            try:
                e.cache.rebuild(moe=8, kv=256)
            finally:
                e.cache.rebuilder.fault_at = e.cache.rebuilder.fault_in_undo = None

        with pytest.raises(RebuildFailed):
            loop.call_sync(break_it, timeout=60)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "shrink kv" in health.json()["degraded"]
        state = CacheState.model_validate(client.get("/admin/cache").json())
        assert state.degraded and f"DEGRADED: {state.degraded}" in format_cache(state)
        assert state.pools.kv.size == 256  # what the pools hold, not the geometry before the rebuild
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _suggestions(reason: str) -> list[dict[str, int]]:
    """The targets a joint refusal suggests: 'reachable instead: moe 416 with kv 64, or kv 128 with moe 450'."""
    import re

    if "reachable instead: " not in reason:
        return []
    text = reason.split("reachable instead: ")[1].split(" (the ranges")[0]
    out = []
    for part in text.split(", or "):
        out.append({p: int(n) for p, n in re.findall(r"(moe|kv|mamba) (\d+)", part)})
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac_moe=st.floats(0, 1), frac_kv=st.floats(0, 1), frac_mamba=st.floats(0, 1))
def test_joint_targets_reachable_or_refused_with_the_constraint(backend_llm, frac_moe, frac_kv, frac_mamba):
    """Targets that move several pools, each inside its advertised range (which holds the others at
    their current sizes): the dry run decides; a refused one names the joint budget with numbers
    and suggests targets that really fit; a refused rebuild touches nothing."""
    llm, _ = backend_llm
    e = llm.engine
    g, ranges, lay = e.cache.geometry, e.cache.reachable_ranges(), e.cache.layout
    want = {}
    for p, f in (("moe", frac_moe), ("kv", frac_kv), ("mamba", frac_mamba)):
        lo, hi = ranges[p]
        want[p] = lay.round_size(p, lo + int(f * (hi - lo))) if hi >= lo else g.sizes()[p]
    plan = e.cache.plan_resize(**want)
    if plan.fits:
        e.cache.rebuild(**want)
        assert e.cache.geometry.sizes() == want
        if e.cache.plan_resize(**g.sizes()).fits:  # back for the next example (realloc may not reach it)
            e.cache.rebuild(**g.sizes())
        return
    assert "together need a peak of" in plan.reason and "the rebuild budget is" in plan.reason
    held = e.cache.storage.held_bytes()
    with pytest.raises(RebuildRefused):
        e.cache.rebuild(**want)
    assert e.cache.geometry == g and e.cache.storage.held_bytes() == held
    for target in _suggestions(plan.reason):
        assert e.cache.plan_resize(**{**want, **target}).fits, (plan.reason, target)


def test_rebuilds_and_refusals_are_logged(tiny_one, caplog):
    """One line per rebuild in the server log, with the change, the status and the peak; a ladder
    refusal as a warning."""
    import logging

    _, _, path = tiny_one
    e = _llm(path, "mmap").engine
    with caplog.at_level(logging.INFO, logger="ft.cache"):
        e.cache.rebuild(kv=256)
        e.cache.record("ladder", "grow to rung 3 for request r1", "refused", "rung 3 leaves less than the expert floor 4")
    lines = [r.getMessage() for r in caplog.records if r.name == "ft.cache"]
    assert lines[0].startswith("rebuild #1 (manual): kv 512->256: ok in ") and "peak" in lines[0]
    assert lines[1] == ("rebuild #2 (ladder: grow to rung 3 for request r1): no change: refused: rung 3 leaves less "
                        "than the expert floor 4")
    assert [r.levelno for r in caplog.records if r.name == "ft.cache"] == [logging.INFO, logging.WARNING]


def test_closed_engine_frees_its_pools_without_waiting_for_the_cycle_collector(tiny_one):
    """An engine dropped by its caller takes its pools with it at once (no reference cycle through
    the cache manager): a second engine made right after in the same process measures its budget
    with that memory free (on a GPU, a pool kept until a gc pass left a later engine 15 GB short)."""
    import gc
    import weakref

    _, _, path = tiny_one
    gc.collect()
    gc.disable()
    try:
        llm = _llm(path, "realloc")
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0))
        pools = weakref.ref(llm.engine.pools)
        llm.close()
        del llm
        assert pools() is None
    finally:
        gc.enable()
