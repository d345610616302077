"""Launch a Triton kernel with the first of its configurations that the GPU can hold.

A kernel's preferred configuration (the one measured fastest on the H200 at the flagship's shapes)
can ask for more shared memory than a block may have at other shapes: a wider head dim, fp32
operands, or a smaller card (an RTX 5090 block gets 99 KiB, an H200's 227 KiB). Triton raises
`OutOfResources` when it loads such a kernel, before anything is launched, so trying the next,
smaller configuration is safe: nothing ran and no memory was touched (issue 37: the gated-delta state
pass at key dim 256 asked for 309 KiB, at fp32 and key dim 128 for 281 KiB).

Each caller gives an ordered list of configurations (`fallback_stages` builds the usual one: fewer
pipeline stages first, since software pipelining is what multiplies the staged tiles) and a key that
names the compiled variant; the index that fit is remembered per key, so the search happens once
per process and shape class, and every later launch goes straight to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

from triton.runtime.errors import OutOfResources

__all__ = ["fallback_stages", "launch_fitting"]

log = logging.getLogger(__name__)

_FITTING: dict[Hashable, int] = {}
"""key -> index of the first configuration of its list that loaded on this process's GPU."""


def fallback_stages(config: dict, *narrower: dict) -> list[dict]:
    """`config`, then `config` with each smaller `num_stages` down to 1, then each of `narrower` (changes
    applied on top of `config`, in order) with 1 stage: the candidates of `launch_fitting`, preferred first."""
    stages = config.get("num_stages", 2)
    out = [config] + [{**config, "num_stages": s} for s in range(stages - 1, 0, -1)]
    out += [{**config, **change, "num_stages": 1} for change in narrower]
    return out


def launch_fitting(kernel, grid: Callable[[dict], tuple], args: Sequence, configs: Sequence[dict],
                   key: Hashable, **kwargs) -> dict:
    """Launch `kernel[grid(config)](*args, **kwargs, **config)` with the first config of `configs` whose
    compiled kernel the device can hold, starting at the one that fit last time for `key`; returns it.

    `key` must tell apart everything that changes the compiled kernel besides the configuration
    (the argument dtypes and the constexprs in `kwargs`). Raises the last `OutOfResources` when none fits."""
    first = _FITTING.get(key, 0)
    error: OutOfResources | None = None
    for i in range(first, len(configs)):
        config = configs[i]
        try:
            kernel[grid(config)](*args, **kwargs, **config)
        except OutOfResources as exc:
            error = exc
            continue
        if i != first:
            _FITTING[key] = i
            log.info("%s: the preferred configuration needs more than this GPU has (%s); using %s",
                     getattr(kernel, "__name__", kernel), error, _describe(config, configs[0]))
        return config
    assert error is not None
    raise error


def _describe(config: dict, preferred: dict) -> str:
    """The entries where `config` differs from `preferred`, for the log line."""
    changed = {k: v for k, v in config.items() if preferred.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "the preferred configuration"
