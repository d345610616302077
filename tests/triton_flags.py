"""Test helper for the constexpr flags that the Triton wrappers compute from shapes (EVEN_D, EVEN_K,
...): `spy_launches` replaces a kernel in its module by a stand-in that records each launch's keyword
arguments (constexprs and launch options, as the wrapper passed them) and launches the real kernel
with some of them overridden, e.g. EVEN_D=False to run the masked path on a shape where the wrapper
sets EVEN_D=True. Launches must index the kernel by its grid (`kernel[grid](...)`), as the wrappers do."""

from __future__ import annotations


class _LaunchSpy:
    def __init__(self, kernel, calls: list[dict], overrides: dict):
        self.kernel, self.calls, self.overrides = kernel, calls, overrides

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(dict(kwargs))
            return self.kernel[grid](*args, **{**kwargs, **self.overrides})

        return launch


def spy_launches(monkeypatch, module, name: str, **overrides) -> list[dict]:
    """Replace `module.<name>` (a Triton kernel) for the test; -> the list that collects each launch's
    keyword arguments as the caller passed them (before `overrides` replace some)."""
    calls: list[dict] = []
    monkeypatch.setattr(module, name, _LaunchSpy(getattr(module, name), calls, overrides))
    return calls
