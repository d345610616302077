"""QSA's sparse attention at a prefill's shape: thousands of queries of one long prompt, each over the
2,051 positions its indexer chose. Not a test.

    PYTHONPATH=. python3 bench/qsa_attention.py [--context 16384] [--rows 4096] [--lists random,local]
        [--variants default,qsa-sparse-combine] [--tile 64,4,3[,combine] ...]

Qwen3.8-Flash-Next's QSA layer (24 query heads over 2 KV heads of 256, budget 2,048 tokens in blocks of
4, the engine's page of 64 tokens in a shuffled order): one `sparse_decode_attention` launch as
`QSAAttention._sparse` makes it in a prefill past the dense span, `--rows` queries at the prompt's last
positions, each list its own. Lists: `random` draws each query's 512 blocks uniformly from its complete
blocks (independent from query to query: what a synthetic model's indexer gives), `local` takes the 512
blocks before the query (neighbours share almost every position: the kindest case for the cache). Every
list ends with the query's incomplete block. Variants: named `ft.kernels.options.VARIANTS` ("default":
none) and ad-hoc `QsaOptions.one_split_tile`s (`--tile N,WARPS,STAGES`). Prints us per launch, queries
per ms, the K and V bytes the lists gather per second (most come from L2: a 16K context's cache is 32
MB), and each variant's relative RMS against the fp32 reference on the first 32 rows. Table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import graph_us, rel_rms  # noqa: E402
from ft.kernels.attention.reference import sparse_decode_attention_ref  # noqa: E402
from ft.kernels.attention.sparse_decode import sparse_decode_attention_triton  # noqa: E402
from ft.kernels.options import use_kernel_options, variant  # noqa: E402


def token_lists(context: int, rows: int, budget_blocks: int, ratio: int, kind: str, device) -> torch.Tensor:
    """[rows, budget_blocks * ratio + ratio - 1] int64 positions (-1: unused) of the queries at positions
    context - rows .. context - 1: `kind` "random" or "local" complete blocks, then the query's own
    incomplete block (its positions up to the query's)."""
    pos = torch.arange(context - rows, context, device=device)
    complete = pos // ratio  # complete blocks before each query: 0 .. complete - 1
    if kind == "random":
        scores = torch.rand(rows, int(complete.max()), device=device, generator=torch.Generator(device).manual_seed(0))
        scores[torch.arange(scores.shape[1], device=device)[None, :] >= complete[:, None]] = -1.0
        blocks = scores.topk(budget_blocks, dim=1).indices
    elif kind == "local":
        blocks = complete[:, None] - 1 - torch.arange(budget_blocks, device=device)[None, :]
    else:
        raise SystemExit(f"--lists: {kind!r} is neither random nor local")
    chosen = (blocks[:, :, None] * ratio + torch.arange(ratio, device=device)).reshape(rows, -1)
    tail = complete[:, None] * ratio + torch.arange(ratio - 1, device=device)[None, :]
    tail = torch.where(tail <= pos[:, None], tail, -1)
    return torch.cat([chosen, tail], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=4096, help="queries a launch (the prompt's last ones)")
    ap.add_argument("--lists", default="random,local")
    ap.add_argument("--variants", default="default,qsa-sparse-combine")
    ap.add_argument("--tile", action="append", default=[], metavar="N,WARPS,STAGES[,combine]",
                    help="an ad-hoc QsaOptions.one_split_tile (and _quantized), timed as a variant of its own (with ',combine': "
                         "the partials and the combine launch, variant qsa-sparse-combine's path, at that tile)")
    ap.add_argument("--kv", choices=["bf16", "fp8"], default="bf16")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, page, ratio, budget = 24, 2, 256, 64, 4, 2048
    ctx, rows = args.context, args.rows
    if rows > ctx - budget:
        raise SystemExit(f"--rows {rows}: at most --context - {budget} (queries past the dense span)")
    gen = torch.Generator(device=dev).manual_seed(1)
    pages = -(-ctx // page)
    table = torch.randperm(pages, device=dev, generator=gen)[None, :]
    k = torch.randn(pages, page, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(pages, page, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    scale = None
    if args.kv == "fp8":
        scale = torch.tensor([0.02, 0.02], device=dev)
        k, v = (k.float() / 0.02).to(torch.float8_e4m3fn), (v.float() / 0.02).to(torch.float8_e4m3fn)
    q = torch.randn(rows, hq, d, device=dev, generator=gen).to(torch.bfloat16)
    out_rows = []
    specs = [(name, variant() if name == "default" else variant(name)) for name in args.variants.split(",")]
    for t in args.tile:
        fields = t.split(",")
        combine = fields[3:] == ["combine"]
        if len(fields) != 3 and not combine:
            raise SystemExit(f"--tile {t!r}: N,WARPS,STAGES[,combine]")
        n, w, s = (int(x) for x in fields[:3])
        specs.append((f"tile {n}x{w}w{s}s" + (" combine" if combine else ""),
                      variant(**{"qsa.one_split_tile": (n, w, s), "qsa.one_split_tile_quantized": (n, w, s),
                                 **({"qsa.one_pass": False} if combine else {})})))
    for kind in args.lists.split(","):
        tokens = token_lists(ctx, rows, budget // ratio, ratio, kind, dev)
        tables = table.expand(rows, -1)
        ref = sparse_decode_attention_ref(q[:32].float(), k, v, tables[:32], tokens[:32], d ** -0.5, scale)
        gathered = rows * hkv * int((tokens >= 0).sum(1).float().mean()) * d * 2 * k.element_size()
        for label, opts in specs:
            with use_kernel_options(opts):
                out = torch.empty(rows, hq, d, device=dev, dtype=torch.bfloat16)

                def call():
                    out.copy_(sparse_decode_attention_triton(q, k, v, tables, tokens, d ** -0.5, scale))

                us = graph_us([call], replays=5, trials=5)
                err = rel_rms(out[:32], ref)
            out_rows.append((kind, label, us, rows / us * 1e3, gathered / us / 1e3, err))
            print(f"{kind} {label}: {us:.1f} us, {rows / us * 1e3:.0f} queries/ms, {gathered / us / 1e3:.0f} GB/s "
                  f"gathered, rel rms {err:.2e}", flush=True)
    print(f"\n{rows} queries at positions {ctx - rows}..{ctx - 1} of one {ctx}-token prompt, {hq} q heads over {hkv} kv "
          f"heads of {d}, lists of {budget} + {ratio - 1}, {args.kv} KV, page {page} (the launch includes one "
          f"copy of its output)")
    print("| lists | variant | us a launch | queries/ms | K+V gathered GB/s | rel RMS vs reference |")
    print("|---|---|---:|---:|---:|---:|")
    for kind, label, us, qpms, gbs, err in out_rows:
        print(f"| {kind} | {label} | {us:,.1f} | {qpms:,.0f} | {gbs:,.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
