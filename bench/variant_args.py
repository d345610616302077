"""`--define NAME=JSON` for the benchmarks: ad-hoc kernel-option variants, registered beside the named ones
(`ft.kernels.options.VARIANTS`) so that `--variant NAME` / `--modes MODE:NAME` take them like any other."""

from __future__ import annotations

import json

from ft.kernels.options import VARIANTS, variant

DEFINE_HELP = "an ad-hoc variant: options keyed 'operation.field' as JSON (lists become tuples); repeatable"


def _tuples(value):
    """JSON lists as tuples, nested (the kernel options' tile fields are tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def define_variants(specs: list[str]) -> None:
    """Registers each "NAME=JSON" of `specs` in `VARIANTS`. Raises SystemExit (one line) for an empty name, a
    name already taken, JSON that does not parse or an option that does not exist, before any engine is up."""
    for spec in specs:
        name, _, body = spec.partition("=")
        if not name or name in VARIANTS:
            raise SystemExit(f"--define NAME=JSON: {name!r} is empty or a named variant already")
        try:
            VARIANTS[name] = {key: _tuples(value) for key, value in json.loads(body).items()}
            variant(name)  # (an unknown option fails here, not after the engine is up)
        except (ValueError, TypeError, AttributeError) as exc:
            VARIANTS.pop(name, None)
            raise SystemExit(f"--define {name}: {exc}") from None
