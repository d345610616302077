"""Where a model comes from: the one seam between the engine and the tools that make models.

`--model` names one of three sources: a checkpoint directory (Hugging Face layout), the built-in
demo ("demo", or nothing: a small random Qwen3-Next written by `ft.tools.demo` on first use), or
`synthetic:CONFIG.json` (random NVFP4 weights made from a config alone by `ft.tools.synthetic`, for
benchmarks at real sizes without a download). `model_source` resolves the name once; the engine
asks the source for the config's path, the tokenizer's directory, made weights (synthetic only) and
the config's raw fields, and imports none of those tools itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEMO_NAMES", "ModelSource", "model_source"]

DEMO_NAMES = (None, "", "demo")
"""`--model` values that mean the built-in demo model."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`. path: the checkpoint directory (the demo's too), or the synthetic
    config file; synthetic: the weights are made, not read."""

    spec: str | None
    path: Path
    synthetic: bool

    def tokenizer_dir(self) -> Path:
        """The checkpoint's directory; for a synthetic model, the demo's byte-level tokenizer (made
        once in the cache directory)."""
        if not self.synthetic:
            return self.path
        from ft.tools.demo import default_cache_dir, write_tokenizer_files

        path = default_cache_dir() / "demo-tokenizer-v1"
        if not (path / "tokenizer.json").is_file():
            write_tokenizer_files(path)
        return path

    def made_weights(self, specs: dict, expert_names: list, dtype, device, seed: int, shard: tuple[int, int],
                     tables_on_disk: bool = False):
        """A synthetic model's weights (`ft.tools.synthetic.synthetic_weights`: this rank's `shard`
        (rank, world); its tables written to a file and mapped with `tables_on_disk`); None for a
        checkpoint, whose weights the loader reads."""
        if not self.synthetic:
            return None
        from ft.tools.synthetic import synthetic_weights

        return synthetic_weights(specs, expert_names, dtype, device, seed, shard=shard, tables_on_disk=tables_on_disk)

    def raw_config(self) -> dict[str, Any]:
        """The config file's fields as written (a synthetic config's benchmark fields, e.g.
        "routing_trace", which the model's config does not keep)."""
        return json.loads((self.path if self.synthetic else self.path / "config.json").read_text())


def model_source(spec: str | None) -> ModelSource:
    """Resolve `--model` (the demo is written here on its first use)."""
    from ft.tools.synthetic import config_path, is_synthetic

    if is_synthetic(spec):
        return ModelSource(spec, config_path(spec), True)
    if spec in DEMO_NAMES:
        from ft.tools.demo import ensure_demo_checkpoint

        return ModelSource(spec, ensure_demo_checkpoint(), False)
    return ModelSource(spec, Path(spec).expanduser(), False)
