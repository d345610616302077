"""Counters for the "last program finishes" pattern that several kernels share (the NVFP4 tile's split K,
the HyperConnection read's down projection): the programs of a group each store a partial, take a ticket
(an atomic add on the group's counter) and the one that draws the last ticket sums the partials in a
fixed order and resets the counter, so the sum is the same whichever program arrives last.

Per device one set of int32 counters serves every launch: launches on a device's stream run one after
another (a PDL launch's programs wait for the launch before them first), and each leaves its counters
at zero. A launch needing more counters than the set holds adds a larger set; earlier sets are kept,
since CUDA graphs captured with them hold their addresses."""

from __future__ import annotations

import torch

__all__ = ["ticket_counter_sets", "ticket_counters"]

_SETS: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 4096
"""Counters in a set at least (one a group: a split-K tile, a read's row tile)."""


def ticket_counters(device: torch.device, groups: int) -> torch.Tensor:
    """At least `groups` zero int32 counters on `device` (made in a CUDA graph's capture, the zeroing is
    recorded into it as well, which a replay repeats harmlessly)."""
    sets = _SETS.setdefault(device, [])
    if not sets or sets[-1].numel() < groups:
        sets.append(torch.zeros(max(MIN_COUNTERS, groups), dtype=torch.int32, device=device))
    return sets[-1]


def ticket_counter_sets(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every counter set made on `device`, oldest first."""
    return tuple(_SETS.get(device, ()))
