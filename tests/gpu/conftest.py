"""GPU tests: every test here carries the ``gpu`` marker and is skipped without a CUDA device.

Run them on the device machine in their own pytest process: ``python -m pytest -q tests/gpu``. With
pytest-xdist, `MAX_WORKERS_A_CARD` workers a card at most (more is refused in one line): some cases take 20-30 GiB
each, and eight workers ran an 80 GB card out of memory (session 59's sweep: 40 failures, all passing again in two).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_GPU = "needs a CUDA GPU (run through the device tool)"
INTERPRETED = "run tests/gpu in a pytest process of its own: the CPU tests' TRITON_INTERPRET=1 is on"


def _only_this_folder(config: pytest.Config) -> bool:
    paths = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    return bool(paths) and all(p == HERE or HERE in p.parents for p in paths)


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: tests/conftest.py sets TRITON_INTERPRET=1 for the CPU kernel tests, and triton.jit reads it
    # when a kernel module is imported. When only this folder runs, it is cleared before its modules
    # import the kernels, so that they compile for the GPU; in a mixed run they are skipped instead.
    if torch.cuda.is_available() and _only_this_folder(config):
        os.environ.pop("TRITON_INTERPRET", None)
        workers = getattr(config.option, "numprocesses", None)  # (pytest-xdist's -n, where it is installed)
        if isinstance(workers, int) and workers > MAX_WORKERS_A_CARD * torch.cuda.device_count():
            raise pytest.UsageError(f"tests/gpu: at most {MAX_WORKERS_A_CARD} xdist workers a card "
                                    f"({torch.cuda.device_count()} here), got -n {workers}: some cases take 20-30 GiB "
                                    "each, and more workers run the card out of memory")


MAX_WORKERS_A_CARD = 2
"""pytest-xdist workers a card may run (session 59: eight on one 80 GB card failed 40 cases out of memory, all passing
in two)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``gpu``; skip them without CUDA or under the Triton interpreter."""
    reason = NO_GPU if not torch.cuda.is_available() else INTERPRETED if os.environ.get("TRITON_INTERPRET") == "1" else None
    for item in items:
        if HERE not in item.path.resolve().parents:
            continue  # NOTE: this hook sees the whole session's items
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """`gpu.small_model.SMALL_BF16_CONFIG` as a synthetic model name (weights made on the device)."""
    from gpu.small_model import SMALL_BF16_CONFIG

    path = tmp_path_factory.mktemp("synthetic") / "config.json"
    path.write_text(json.dumps(SMALL_BF16_CONFIG))
    return f"synthetic:{path}"
