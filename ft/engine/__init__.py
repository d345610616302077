"""The engine: model, cache pools, scheduler and the `LLM` Python API.

`from ft.engine import LLM` is the entry point that tests and benchmarks share. Submodules are
imported lazily so that light modules (tokenizer, demo) load without the whole engine.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from ft.engine.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ft.engine.base.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
