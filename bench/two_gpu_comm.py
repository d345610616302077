"""What the two-GPU decode pays to communicate, per step (issue 18's choice between TP and PP). Not a test.

    python3 bench/two_gpu_comm.py [--rows 1,8] [--hidden 2048] [--per-graph 96] [--device cuda|cpu]

Two processes, one per GPU, torch.distributed over NCCL (gloo with --device cpu: a smoke run of
the script). For an activation x [rows, hidden] in bf16 it times:

* the tensor-parallel step's communication: an all-reduce of x, eagerly and replayed in a CUDA
  graph that holds --per-graph of them back to back (96 = two per layer of a 48-layer model: after
  the mixer's output projection and after the MoE), in microseconds per all-reduce;
* the pipeline-parallel step's: a hop of x from rank 0 to rank 1 and back (send / recv), eager,
  microseconds per round trip (a two-stage pipeline at batch 1 pays one round trip per step).

Multicast stays off (NCCL_NVLS_ENABLE=0, as the machine asks). Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _worker(rank: int, args, port: int, out) -> None:
    try:
        _measure(rank, args, port, out)
    except BaseException:  # NOTE: a rank that fails must not leave the other waiting in a collective
        traceback.print_exc()
        os._exit(1)


def _measure(rank: int, args, port: int, out) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # NOTE: torch's CUDA-graph notes: NCCL collectives may be captured (NCCL >= 2.9.6) with the
    # process group's asynchronous error handling off (its watchdog queries events the capture owns)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device=dev)
        eager = _time(lambda: dist.all_reduce(x), 200, sync) * 1e6
        graph_us = float("nan")
        if cuda and args.per_graph:
            buf = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # NCCL warm-up on the capture stream
                for _ in range(3):
                    dist.all_reduce(buf)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(args.per_graph):
                    dist.all_reduce(buf)
            graph_us = _time(g.replay, 50, sync) * 1e6 / args.per_graph
        dist.barrier()

        def hop():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        hop_us = _time(hop, 200, sync) * 1e6
        rows_out.append((rows, eager, graph_us, hop_us))
    if rank == 0:
        out.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--per-graph", type=int, default=96, help="all-reduces per CUDA graph (0: no graph)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for the ranks")
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs two GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    print(f"\n{'rows':>4} {'all-reduce eager us':>20} {'all-reduce in graph us':>23} {'PP round trip us':>17} "
          f"{'TP comm per step ms':>20}")
    for r, eager, graph_us, hop_us in rows:
        per_step = (graph_us if graph_us == graph_us else eager) * args.per_graph / 1e3
        print(f"{r:>4} {eager:>20.1f} {graph_us:>23.1f} {hop_us:>17.1f} {per_step:>20.2f}")


if __name__ == "__main__":
    main()
