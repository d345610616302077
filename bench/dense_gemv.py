"""Dense bf16 skinny GEMM at decode batch sizes: the Triton kernel (`ft.kernels.dense`) against
``F.linear`` (cuBLAS), in CUDA graphs, reading weights from HBM; tables last.

Usage (device): ``PYTHONPATH=. python3 bench/dense_gemv.py [--sweep] [--m 1,8] [--shapes router,gate] [--log FILE]``
Script check on the CPU: ``TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/dense_gemv.py --dry-run --sweep``

Shapes (N x K) from Qwen3-Next-80B-A3B decode, where cuBLAS took ~5 us each in the engine's graphs:
the MoE router 512 x 2048 (2 MB), 513 x 2048 (a partial last block of rows), in_proj_ba 64 x 2048
(256 KB) and the 1-row shared-expert gate 1 x 2048 (4 KB); Qwen3.8-Flash-Next's router with its shared gate
513 x 2560 and in_proj_ba 96 x 2560 (K not a multiple of the 2,048-wide tile); M = 1 and 8 rows of x.

Timing: `bench.gpu_timing.graph_us`: a CUDA graph of one call per weight copy, replayed. Each call
reads its own copy of W; where all copies together are less than 4x the 50 MB L2 (the small
shapes: 512 copies of a 4 KB gate are 2 MB), each replay also starts with a memset of 4x the L2,
timed alone and subtracted, so that every call reads W from HBM as in a real decode step (x stays
in L2: it was just written there). GB/s counts W + x read and y written once; the ceiling is the
measured 4.3 TB/s copy. ``--sweep`` also times the block configurations of `sweep_configs` (each
checked against the reference first) and lists the best per case.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton

from bench.gpu_timing import COPY_CEILING_GBS, L2_BYTES, copies_for, graph_us, rel_rms
from ft.kernels.dense import dense_linear_ref
from ft.kernels.dense.kernel import default_config, dense_linear_triton

SHAPES = [("router", 512, 2048), ("router+1", 513, 2048), ("in_proj_ba", 64, 2048), ("gate", 1, 2048),
          # Qwen3.8-Flash-Next (hidden 2,560: the whole-K tile of 2,048 leaves a masked second tile of 512)
          ("fn_router+1", 513, 2560), ("fn_in_proj_ba", 96, 2560)]
M_CASES = (1, 8)
TOL = 2.0**-7  # relative RMS against the fp32-accumulated reference rounded to bf16: at most one bf16 unit
MAX_CALLS = 512  # graph nodes per pass
DEV = torch.device("cuda")
DTYPE = torch.bfloat16


def sweep_configs(m: int, n: int, k: int) -> list[dict]:
    """Block configurations to time: BLOCK_M up to M's power of two, BLOCK_N up to N / 32 (>= 32
    programs), the whole K, half or a quarter of it per tile (bf16: 2048, 1024 or 512), 1-8 warps with every
    thread along K; leaving out those holding more than ~256 fp32 values of the two tiles per
    thread (they spill)."""
    out = []
    for bm, bn, bk, nw in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (512, 1024, 2048), (1, 2, 4, 8)):
        if bm > triton.next_power_of_2(m) or bn > max(1, n // 32) or bk > max(16, triton.next_power_of_2(k)):
            continue
        if nw * 32 * 8 > bk or (bm + bn) * bk // (32 * nw) > 256:
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw})
    return out


def cfg_str(cfg: dict) -> str:
    return f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']}"


class Case:
    """One N x K bf16 weight in rotated copies, x [M, K] and y [M, N] buffers, and an L2 flush when
    the copies are too few to push each other out of L2."""

    def __init__(self, m: int, n: int, k: int):
        self.m, self.n, self.k = m, n, k
        self.copies = min(MAX_CALLS, copies_for(n * k * 2))
        self.w = (torch.randn(self.copies, n, k, device=DEV) * 0.05).to(DTYPE)
        self.x = torch.randn(m, k, device=DEV, dtype=DTYPE)
        self.y = torch.empty(m, n, device=DEV, dtype=DTYPE)
        self.flush = None
        if self.copies * n * k * 2 < 4 * L2_BYTES:
            self.flush = torch.empty(4 * L2_BYTES // 4, device=DEV, dtype=torch.float32)
            self.flush_us = graph_us([self.flush.zero_])

    def time(self, fn) -> float:
        """Microseconds per call of fn(x, w_i), each call on its own copy of W, in a CUDA graph."""
        calls = [partial(fn, self.x, self.w[i]) for i in range(self.copies)]
        if self.flush is None:
            return graph_us(calls)
        total = graph_us([self.flush.zero_, *calls]) * (len(calls) + 1)
        return max(0.0, total - self.flush_us) / len(calls)

    def check(self, fn) -> float:
        """Relative RMS of fn against the reference on a fresh x, the output poisoned with NaN first."""
        x = torch.randn(self.m, self.k, device=DEV, dtype=DTYPE)
        out = torch.full((self.m, self.n), float("nan"), device=DEV, dtype=DTYPE)
        fn(x, self.w[0], out=out)
        return rel_rms(out, dense_linear_ref(x, self.w[0]))

    def nbytes(self) -> int:
        return (self.n * self.k + self.m * self.k + self.m * self.n) * 2


def run_case(name: str, n: int, k: int, m: int, args, say, failures, sweep_rows) -> tuple:
    case = Case(m, n, k)
    err = case.check(dense_linear_triton)
    if not err <= TOL:
        failures.append((name, m, err))
    t_tri = case.time(partial(dense_linear_triton, out=case.y))
    t_ref = case.time(F.linear)
    default = default_config(m, n, k, DTYPE)
    best = (cfg_str(default), t_tri)
    if args.sweep:
        for cfg in sweep_configs(m, n, k):
            try:
                e = case.check(partial(dense_linear_triton, config=cfg))
                tc = case.time(partial(dense_linear_triton, out=case.y, config=cfg)) if e <= TOL else float("inf")
            except Exception as exc:  # noqa: BLE001 (a configuration the compiler refuses)
                say(f"  sweep {name} M{m} {cfg_str(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            say(f"  sweep {name} M{m} {cfg_str(cfg)}: {tc:.2f} us, rel RMS {e:.1e}")
            sweep_rows.append((name, m, cfg, tc))
            if tc < best[1]:
                best = (cfg_str(cfg), tc)
    gbs = case.nbytes() / (max(t_tri, 1e-3) * 1e-6) / 1e9
    say(f"{name} {n}x{k} M{m}: Triton {t_tri:.2f} us ({gbs:.0f} GB/s), F.linear {t_ref:.2f} us, rel RMS {err:.1e}, "
        f"{case.copies} copies{', L2 flushed per pass' if case.flush is not None else ''}")
    return (name, f"{n}x{k}", m, t_tri, gbs, t_ref, err, cfg_str(default), best)


def _table(say, header: list[str], rows: list[list[str]]) -> None:
    say("")
    say("| " + " | ".join(header) + " |")
    say("|" + "---|" * len(header))
    for r in rows:
        say("| " + " | ".join(r) + " |")


def _dry_run_setup() -> None:
    """CPU, Triton interpreter, shapes / 16, two copies, wall-clock timing: checks the script, not the kernel."""
    import os
    import time

    global DEV, SHAPES, MAX_CALLS, L2_BYTES, graph_us, copies_for, sweep_configs
    assert os.environ.get("TRITON_INTERPRET") == "1", "--dry-run needs TRITON_INTERPRET=1 (set before triton is imported)"
    os.environ["FT_TRITON_INTERPRET_TEST"] = "1"
    DEV = torch.device("cpu")
    SHAPES = [(nm, max(1, n // 16), k // 16) for nm, n, k in SHAPES]
    MAX_CALLS, L2_BYTES = 2, 2**16

    def two_copies(*_, **__) -> int:
        return 2

    def small_sweep(m: int, n: int, k: int) -> list[dict]:
        return [{"BLOCK_M": min(2, triton.next_power_of_2(m)), "BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 1},
                {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 128, "num_warps": 2}]

    copies_for, sweep_configs = two_copies, small_sweep

    def cpu_us(calls, **_):
        t0 = time.perf_counter()
        for fn in calls[:2]:
            fn()
        return (time.perf_counter() - t0) * 1e6 / min(2, len(calls))

    graph_us = cpu_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the block configurations of sweep_configs")
    ap.add_argument("--m", default=",".join(map(str, M_CASES)), help="rows of x, comma-separated (the dispatcher takes the kernel up to DenseOptions.max_m; any M is timed)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="shape names, comma-separated")
    ap.add_argument("--log", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, shapes / 16: checks the script")
    args = ap.parse_args()
    if args.dry_run:
        _dry_run_setup()
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (open for the whole run)

    def say(*a):
        print(*a, flush=True)
        if log:
            print(*a, file=log, flush=True)

    say(DEV, torch.cuda.get_device_name() if DEV.type == "cuda" else "", torch.__version__, triton.__version__)
    torch.manual_seed(0)
    failures, rows, sweep_rows = [], [], []
    names = args.shapes.split(",")
    for name, n, k in SHAPES:
        if name not in names:
            continue
        for m in (int(v) for v in args.m.split(",")):
            rows.append(run_case(name, n, k, m, args, say, failures, sweep_rows))
            torch.cuda.empty_cache() if DEV.type == "cuda" else None
    if sweep_rows:
        top = []
        for (name, m), group in itertools.groupby(sweep_rows, key=lambda r: (r[0], r[1])):
            for rank, (_, _, cfg, us) in enumerate(sorted(group, key=lambda r: r[3])[:5], 1):
                top.append([name, str(m), str(rank), cfg_str(cfg), f"{us:.2f}"])
        _table(say, ["sweep: shape", "M", "rank", "config (BLOCK_M, BLOCK_N, BLOCK_K, warps)", "us"], top)
    _table(say, ["shape", "N x K", "M", "Triton us", "GB/s", "of 4.3 TB/s", "F.linear us", "F.linear / Triton", "rel RMS",
                 "default config", "best swept (us)"],
           [[name, nk, str(m), f"{us:.2f}", f"{gbs:.0f}", f"{gbs / COPY_CEILING_GBS:.0%}", f"{us_ref:.2f}",
             f"{us_ref / max(us, 1e-3):.2f}x", f"{e:.1e}", default, f"{best[0]} ({best[1]:.2f})"]
            for name, nk, m, us, gbs, us_ref, e, default, best in rows])
    say("(CUDA-graph replays, each call reading its own copy of W from HBM; x in L2)")
    if failures:
        say("FAILURES:", failures)
        sys.exit(1)
    say(f"all correctness checks passed (rel RMS <= {TOL:g} against the reference)")


if __name__ == "__main__":
    main()
