"""`ft.memory.budget.startup_geometry`: the pools' sizes at startup, on a made-up layout (no model)."""

from __future__ import annotations

import pytest

from ft.errors import ConfigError
from ft.memory.budget import MemoryBudget, startup_geometry
from ft.memory.layout import Geometry, MemoryLayout

MIB = 1 << 20
LAYOUT = MemoryLayout({"kv": (1 * MIB,), "mamba": (4 * MIB,), "moe": (2 * MIB,)}, page_size=64, granularity=1,
                      reallocates=False, backend="vmm")
"""A KV page (64 tokens) of 1 MiB, a mamba slot of 4 MiB, an expert slot of 2 MiB."""


def _geometry(budget_mib: int, **kw) -> Geometry:
    args = {"total_experts": 100, "expert_floor": 10, "context_limit": 64 * 64, "mamba_slots": 4, "num_tokens": None,
            "moe_backend": "resident", "moe_cache_size": None, **kw}
    return startup_geometry(MemoryBudget(budget_mib * MIB, budget_mib * MIB, 0, budget_mib * MIB), LAYOUT, **args)


def test_kv_takes_the_rest_once_every_expert_is_resident():
    """Resident, 1,000 MiB: experts 200, mamba 16, one context of KV 64 pages; the rest (720 MiB)
    goes to KV only when asked: 784 pages in all, every byte of the budget."""
    assert _geometry(1000) == Geometry(100, 64 * 64, 4)
    grown = _geometry(1000, kv_fill_limit=10**9)
    assert grown == Geometry(100, 784 * 64, 4) and LAYOUT.nbytes(grown) == 1000 * MIB


def test_kv_takes_the_rest_after_an_offloaded_cache_that_holds_every_expert():
    """Offload, auto cache: the experts take what one context of KV leaves, at most every expert;
    only then does the KV grow. A budget too small for every expert keeps one context of KV."""
    assert _geometry(1000, moe_backend="offload", kv_fill_limit=10**9) == Geometry(100, 784 * 64, 4)
    small = _geometry(200, moe_backend="offload", kv_fill_limit=10**9)
    assert small == Geometry(60, 64 * 64, 4)


def test_the_kv_grows_no_further_than_its_fill_limit():
    """The caller's limit (its running requests at the whole context) caps the growth; rounded to pages."""
    assert _geometry(1000, kv_fill_limit=200 * 64) == Geometry(100, 200 * 64, 4)
    assert _geometry(1000, kv_fill_limit=200 * 64 - 10) == Geometry(100, 200 * 64, 4)
    assert _geometry(1000, kv_fill_limit=10 * 64) == Geometry(100, 64 * 64, 4)  # never below one context


def test_an_explicit_kv_size_is_kept():
    assert _geometry(1000, num_tokens=128 * 64, kv_fill_limit=10**9) == Geometry(100, 128 * 64, 4)


def test_a_resident_backend_that_does_not_fit_is_refused_with_the_figures():
    with pytest.raises(ConfigError, match="resident backend keeps every expert"):
        _geometry(150, kv_fill_limit=10**9)


def test_running_requests_default_by_backend_and_device(tiny_one):
    """--max-running-requests when not given: 64 resident on a GPU (nothing traded away), else 8 (an
    offloaded card pays each request's mamba slots in expert slots); the CPU engine decides 8 and the
    config's own readers (mamba slots, graph sizes) see 8 before it is decided."""
    import torch

    from ft.engine.base.engine_config import EngineConfig, default_running_requests
    from test_oracle import make_llm

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_running_requests(cuda, "resident") == 64 and default_running_requests(cuda, "offload") == 8
    assert default_running_requests(cpu, "resident") == 8
    undecided = EngineConfig(model="demo")
    assert undecided.max_running_requests is None and undecided.mamba_slots_for("cpu") == 16
    assert EngineConfig(model="demo", max_running_requests=3).mamba_slots_for("cpu") == 6
    # offloaded on one GPU the prefix cache's states live in host memory: the device holds the running ones
    assert undecided.mamba_slots_for("cuda") == 8 and undecided.prefix_host_entries("cuda") == 8
    assert undecided.prefix_host_entries("cpu") == 0
    resident = EngineConfig(model="demo", moe_backend="resident", max_running_requests=3)
    assert resident.mamba_slots_for("cuda") == 6 and resident.prefix_host_entries("cuda") == 0
    assert EngineConfig(model="demo", max_running_requests=2, prefix_states_on_host=True).mamba_slots_for("cpu") == 2
    assert EngineConfig(model="demo", enable_prefix_cache=False).prefix_host_entries("cuda") == 0
    eng = make_llm(tiny_one[2], moe_backend="resident", max_running_requests=None).engine
    assert eng.config.max_running_requests == 8 and eng.scheduler.max_running == 8


def test_prefill_graphs_need_a_cache_that_could_hold_every_expert():
    """`experts_can_all_be_resident`: the resident backend always; offloaded, only when the experts' bytes
    fit the cache budget and no --moe-cache-size below the model's experts caps the cache."""
    from ft.memory.budget import experts_can_all_be_resident

    assert experts_can_all_be_resident("resident", None, 100, 10**12, 1)
    assert experts_can_all_be_resident("offload", None, 100, 200 * MIB, 200 * MIB)
    assert not experts_can_all_be_resident("offload", None, 100, 200 * MIB + 1, 200 * MIB)
    assert not experts_can_all_be_resident("offload", 99, 100, 1, 200 * MIB)
    assert experts_can_all_be_resident("offload", 100, 100, 1, 200 * MIB)
    assert experts_can_all_be_resident("offload", None, 0, 0, 1)  # a model without experts
