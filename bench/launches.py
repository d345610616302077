"""Device launches of one decode step, counted on the CPU: where a step's kernels come from. Not a test.

    python bench/launches.py [--config bench/configs/qwen3.8-flash-next-small-table.json] [--batch 1]
                             [--layers L] [--moe-backend offload --moe-cache-size N] [--no-shrink] [--top 60]
                             [--prefill --prompt 256]

A decode step on a GPU is latency-bound at small batches: each launch inside the graph costs a few
microseconds whatever it computes, so the count of launches per layer is what fusion has to cut. This
counts them without a GPU: the engine runs a synthetic model on the CPU with the Triton kernels in
Triton's interpreter (the dispatchers take the same Triton path they take on CUDA), and every launch of
one decode step is recorded: each Triton kernel launch, and each torch operator that would be a
device kernel (views, `empty` and other metadata ops are not counted; `item()`-like host reads are
counted apart, as syncs, which a CUDA graph cannot hold). A launch is attributed to the innermost
frame in `ft/model/` (the module line that asked for it).

`--shrink` keeps the config's structure (layer count and kinds, HyperConnection streams, PLE layers,
top-k) and shrinks every width so the interpreter finishes in about a minute; the launch count does
not depend on the widths except where a dispatcher picks a different form by shape (a GEMV's split-K
pass, cuBLAS's own split-K reduce, which this cannot see: they are device-side). Prints a table by
site, then the total per step and per layer kind. `--prefill`: the first prefill step instead (its
launches and its host syncs: a sync there stalls the prompt's whole step, outside any graph); the interpreter
is slow on prefill kernels: 16 tokens through 4 shrunk Flash-Next layers take ~3 min of one core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHRINK = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=32, moe_intermediate_size=64, shared_expert_intermediate_size=64, hc_lowrank=32,
    indexer_head_dim=32, indexer_budget=64, ngram_vocab_size_base=1000, ple_embed_dim=128,
    max_position_embeddings=4096,
)
"""Widths for `--shrink` (the structure's fields, layers, experts per token, streams, stay)."""

_NOT_KERNELS = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "set_", "resize_",
                "_to_copy_noop", "_local_scalar_dense", "is_nonzero", "equal"}
_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique2"}


def _site(root: str) -> str:
    """The innermost frame under `root` above this call: `file.py:function:line` relative to root."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(root):
            return f"{os.path.relpath(name, root)}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "(outside)"


class LaunchCounter(TorchDispatchMode):
    """Counts device launches while `armed`: torch operators that compute (not views or metadata) and
    Triton kernel launches (inside `counting()`), by (site, name); a site is the innermost frame under
    `root` (a folder: the model's code)."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self.armed = False
        self.inside_triton = 0
        self.launches: Counter = Counter()
        self.syncs: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.armed and not self.inside_triton:
            name = func.overloadpacket.__name__
            if name in _SYNCS:
                self.syncs[(_site(self.root), name)] += 1
            if name not in _NOT_KERNELS and not _is_view(func):
                self.launches[(_site(self.root), "aten." + name)] += 1
        return out

    @contextlib.contextmanager
    def counting(self):
        """Inside: torch operators and interpreted Triton launches are counted while `armed` (the
        interpreter's launch is wrapped for the block and put back after)."""
        import triton.runtime.interpreter as interp

        run = interp.InterpretedFunction.run
        counter = self

        def counted(fn_self, *args, grid, warmup, **kwargs):
            if counter.armed and not warmup and not counter.inside_triton:
                counter.launches[(_site(counter.root), "triton." + fn_self.fn.__name__)] += 1
            counter.inside_triton += 1
            try:
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter.inside_triton -= 1

        interp.InterpretedFunction.run = counted
        try:
            with self:
                yield self
        finally:
            interp.InterpretedFunction.run = run


def _is_view(func) -> bool:
    """A view or an operator that makes no tensor (`promote_types`, sizes): no kernel."""
    rets = func._schema.returns
    if not any("Tensor" in str(r.type) for r in rets):
        return True
    return all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def shrunk_config(path: Path, out: Path, layers: int | None = None) -> Path:
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    if layers:
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    for k, v in SHRINK.items():
        if k in text:
            text[k] = v
    text["num_experts_per_tok"] = min(text.get("num_experts_per_tok", 1), text["num_experts"])
    out.write_text(json.dumps(cfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="bench/configs/qwen3.8-flash-next-small-table.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each sequence before the counted step")
    ap.add_argument("--shrink", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--top", type=int, default=60, help="sites listed")
    ap.add_argument("--layers", type=int, default=None, help="layers of the shrunk model (default: the config's)")
    ap.add_argument("--moe-backend", default="resident", choices=("resident", "offload"),
                    help="offload: the experts in host memory, read through by the decode MoE (--moe-cache-size slots)")
    ap.add_argument("--moe-cache-size", type=int, default=None, help="expert slots with --moe-backend offload")
    ap.add_argument("--prefill", action="store_true",
                    help="count the first prefill step (--prompt tokens a sequence) instead of the first decode step")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the engine's kernels)
    os.environ["FT_TRITON_INTERPRET_TEST"] = "1"  # the dispatchers take their Triton kernels on the CPU

    import ft
    from ft.engine.base.engine_config import EngineConfig
    from ft.engine.base.sampling_params import SamplingParams
    from ft.engine.core.engine import Engine


    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp())
    config = shrunk_config(Path(args.config), tmp / "config.json", args.layers) if args.shrink else Path(args.config)
    eng = Engine(EngineConfig(model=f"synthetic:{config}", moe_backend=args.moe_backend,
                              moe_cache_size=args.moe_cache_size, max_running_requests=max(4, args.batch),
                              max_seq_len_override=4096,
                              gpu_memory_limit="2GiB"))
    # sites under the ft imported (maybe another tree's, by PYTHONPATH)
    counter = LaunchCounter(str(Path(ft.__file__).resolve().parent / "model"))
    forward = type(eng.model).forward

    def counted_forward(self, batch, pools):
        counter.armed = (batch.decode is None) == args.prefill and not counter.launches
        try:
            return forward(self, batch, pools)
        finally:
            counter.armed = False

    type(eng.model).forward = counted_forward
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request([(7 * i + j) % 1000 + 3 for j in range(args.prompt)], params) for i in range(args.batch)]
    with counter.counting():
        eng.run_until_done(seqs)
    report(counter, args.top)


def report(counter: LaunchCounter, top: int) -> None:
    by_site: Counter = Counter()
    names: dict[str, Counter] = {}
    for (site, name), n in counter.launches.items():
        by_site[site] += n
        names.setdefault(site, Counter())[name] += n
    total = sum(by_site.values())
    print(f"{'launches':>8}  site (ops)")
    for site, n in by_site.most_common(top):
        ops = ", ".join(f"{k} x{v}" for k, v in names[site].most_common(4))
        print(f"{n:8d}  {site}  ({ops})")
    by_file: Counter = Counter()
    for site, n in by_site.items():
        by_file[site.split(":")[0] + ":" + site.split(":")[1]] += n
    print()
    print("| function | launches a step |")
    print("|---|---|")
    for f, n in by_file.most_common():
        print(f"| {f} | {n} |")
    print(f"| **total** | **{total}** |")
    if counter.syncs:
        print("host reads (syncs) in the step:", dict(counter.syncs))


if __name__ == "__main__":
    main()
