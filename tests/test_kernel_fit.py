"""ft.kernels.fit: the first configuration that loads is launched, the choice is remembered per key,
and a launch where none fits raises Triton's error (issue 37)."""

from __future__ import annotations

import pytest
from triton.runtime.errors import OutOfResources

from ft.kernels import fit


class FakeKernel:
    """Stands for a JIT function: `kernel[grid](*args, **kwargs)`; raises OutOfResources, as Triton does
    when it loads a kernel, for a BLOCK above `limit`."""

    __name__ = "fake_kernel"

    def __init__(self, limit: int):
        self.limit, self.launches, self.tried = limit, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tried.append(kwargs["BLOCK"])
            if kwargs["BLOCK"] * kwargs.get("num_stages", 1) > self.limit:
                raise OutOfResources(kwargs["BLOCK"] * 1000, self.limit * 1000, "shared memory")
            self.launches.append((grid, args, kwargs))
        return launch


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.setattr(fit, "_FITTING", {})


def test_fallback_stages_lowers_stages_then_applies_each_narrower_change_with_one_stage():
    configs = fit.fallback_stages({"BLOCK": 64, "num_stages": 3}, {"BLOCK": 32}, {"BLOCK": 16})
    assert configs == [{"BLOCK": 64, "num_stages": 3}, {"BLOCK": 64, "num_stages": 2}, {"BLOCK": 64, "num_stages": 1},
                       {"BLOCK": 32, "num_stages": 1}, {"BLOCK": 16, "num_stages": 1}]


def test_the_first_configuration_that_loads_is_launched_with_its_grid_and_remembered():
    kernel = FakeKernel(limit=40)
    configs = fit.fallback_stages({"BLOCK": 64, "num_stages": 2}, {"BLOCK": 32})
    chosen = fit.launch_fitting(kernel, lambda c: (100 // c["BLOCK"],), ("x", 7), configs, key="k", FLAG=True)
    assert chosen == {"BLOCK": 32, "num_stages": 1}
    assert kernel.tried == [64, 64, 32]
    assert kernel.launches == [((3,), ("x", 7), {"FLAG": True, "BLOCK": 32, "num_stages": 1})]
    kernel.tried.clear()
    fit.launch_fitting(kernel, lambda c: (1,), (), configs, key="k", FLAG=True)
    assert kernel.tried == [32]  # straight to the one that fit
    fit.launch_fitting(kernel, lambda c: (1,), (), configs, key="other", FLAG=True)
    assert kernel.tried == [32, 64, 64, 32]  # another key searches again


def test_the_preferred_configuration_runs_when_it_fits():
    kernel = FakeKernel(limit=1000)
    configs = fit.fallback_stages({"BLOCK": 64, "num_stages": 2}, {"BLOCK": 32})
    assert fit.launch_fitting(kernel, lambda c: (1,), (), configs, key="k") == configs[0]
    assert kernel.tried == [64]


def test_none_fitting_raises_the_last_out_of_resources():
    kernel = FakeKernel(limit=8)
    configs = fit.fallback_stages({"BLOCK": 64, "num_stages": 2}, {"BLOCK": 32})
    with pytest.raises(OutOfResources):
        fit.launch_fitting(kernel, lambda c: (1,), (), configs, key="k")
    assert kernel.tried == [64, 64, 32]
    assert kernel.launches == []


def test_gated_delta_state_configs_narrow_down_to_16_columns():
    import torch

    from ft.kernels.gated_delta.chunk_kernel import state_configs

    configs = state_configs(1, 4, 256, 48, torch.bfloat16)
    assert configs[0]["num_stages"] > 1 and configs[-1]["BLOCK_V"] == 16
    assert all(c["num_stages"] == 1 for c in configs if c["BLOCK_V"] < configs[0]["BLOCK_V"])
    assert all(c["EVEN_V"] == (48 % c["BLOCK_V"] == 0) for c in configs)
