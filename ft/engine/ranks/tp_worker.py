"""Tensor-parallel worker ranks: processes that run rank 0's forward passes and rebuilds on their shard.

`ft serve --tensor-parallel-size N` (and `Engine(EngineConfig(tensor_parallel_size=N))`) starts
ranks 1..N-1 here, one process per GPU (spawned, torchrun-style but hidden), before rank 0 builds
its own parts; all ranks meet in `ft.parallel.init_group`. A worker builds the same `RankState`
(its shard, its pools sized from its own measured budget) and then serves rank 0's messages:

* ("step", StepInputs): replay the pools' content operations, run the forward (eager or the CUDA
  graph of the bucket rank 0 chose), keep nothing but the pools' new state;
* ("rebuild", order): resize its pools to the order's KV and mamba sizes and its own expert
  slots (`TPRebuild`), answer ok or the error;
* ("describe", None): answer its budget, unit costs and geometry;
* ("stop", None): leave the group and exit.

A worker that fails to start reports its error to rank 0 (the first message of the gather that
ends startup), so that `ft serve` fails with one line instead of waiting. Rank 0's side of the
lifecycle is here too: `start_workers`, `join_group`, `join_ranks` (the startup gather),
`dead_rank` (before each step), `close_ranks`.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass

from ft.engine.base.engine_config import EngineConfig
from ft.parallel import TPGroup, free_port, init_group

log = logging.getLogger("ft.engine")


@dataclass
class Workers:
    """The worker processes of a tensor-parallel engine and the port the ranks meet on."""

    procs: list
    port: int


def start_workers(config: EngineConfig) -> Workers | None:
    """Spawn ranks 1..tensor_parallel_size-1 (None on one GPU)."""
    world = config.tensor_parallel_size
    if world <= 1:
        return None
    from ft.engine.ranks.model_source import model_source
    from ft.model.config import ModelConfig
    from ft.model.tp_split import check_split

    # before any worker starts: the split, and the host's memory for every rank's part of the experts together
    # (a refusal here leaves no worker loading its part)
    source = model_source(config.model)
    model_config = ModelConfig.from_file(source.path, config.model_override_fields)
    check_split(model_config, world)
    import torch
    import torch.multiprocessing as mp

    from ft.errors import ConfigError

    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if config.host_memory_check:  # (the device's type alone: no CUDA context made here before the spawns)
        from ft.engine.ranks.rank_state import host_plan, rank_dtype

        dtype = rank_dtype(config, torch.device("cuda" if cuda else "cpu"))
        host_plan(config, source, model_config, dtype, False)[0].check()
    if cuda:
        if torch.cuda.device_count() < world:
            raise ConfigError(f"--tensor-parallel-size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=worker_main, args=(rank, config, port), name=f"ft-tp-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return Workers(procs, port)


def join_group(config: EngineConfig, rank: int, workers: Workers | None) -> TPGroup | None:
    """Rank 0 joins its workers' group (None on one GPU)."""
    if workers is None:
        return None
    from ft.engine.ranks.rank_state import rank_device

    return init_group(rank, config.tensor_parallel_size, workers.port, rank_device(config.device, rank))


def stop_workers(workers: Workers | None, timeout_s: float = 30.0) -> None:
    """Wait for the worker processes to leave (after a "stop" message), then kill what is left."""
    if not workers:
        return
    for p in workers.procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def join_ranks(tp: TPGroup, cache, workers: Workers | None):
    """Rank 0's startup gather: every worker rank is built (or says why not, raised here as one
    line: ConfigError); their KV and mamba sizes must equal rank 0's `cache`'s (page tables and
    slots are shared). Returns the rebuilds' peers (`TPPeers`); the control channel learns how to
    tell that its readers are alive."""
    from ft.engine.cache.tp_rebuild import TPPeers
    from ft.errors import ConfigError

    answers = tp.gather(cache.describe())
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        raise ConfigError(f"a tensor-parallel rank failed to start: {errors[0]}")
    mine = cache.geometry
    for rank, a in enumerate(answers[1:], start=1):
        g = a["geometry"]
        if (g["kv_tokens"], g["mamba_slots"]) != (mine.kv_tokens, mine.mamba_slots):
            raise ConfigError(f"tensor-parallel rank {rank} sized its caches to {g['kv_tokens']} KV tokens and "
                              f"{g['mamba_slots']} mamba slots, rank 0 to {mine.kv_tokens} and {mine.mamba_slots}: "
                              "give --num-tokens and --mamba-slots explicitly")
    if tp.channel is not None and workers is not None:
        procs = workers.procs
        tp.channel.readers_alive = lambda: all(p.is_alive() for p in procs)
    return TPPeers(tp, answers[1:])


def close_ranks(tp: TPGroup | None, workers: Workers | None, graphs) -> None:
    """Rank 0 stops its worker ranks: "stop" to each, its decode `graphs` released, the group left,
    the processes joined (killed if they stay).

    NOTE: every rank leaves the process group at the same time (NCCL's teardown waits for its
    peers: a worker that left while rank 0 waited for its exit hung both on the H200), each step
    bounded in time so that a dead worker cannot hold the caller."""
    if tp is not None:
        if workers and all(p.is_alive() for p in workers.procs):
            _bounded(lambda: tp.broadcast(("stop", None)), 10.0)
        if graphs is not None:
            graphs.release()
        if not _bounded(tp.destroy, 30.0):
            _bounded(tp.abort, 10.0)  # the group is gone either way: a new engine can start in this process
    stop_workers(workers)


def dead_rank(workers: Workers | None) -> str | None:
    """Why the engine cannot step when a worker rank's process exited (killed, out of memory, a
    crash: it cannot be replaced live), else None."""
    for rank, p in enumerate(workers.procs if workers else [], start=1):
        if not p.is_alive():
            return (f"tensor-parallel rank {rank} exited (exit code {p.exitcode}); "
                    "the engine cannot run without it: restart ft serve")
    return None


def _bounded(fn, timeout_s: float) -> bool:
    """Run fn in a daemon thread for at most timeout_s; whether it finished (a peer that died
    leaves a collective waiting: the caller goes on, the thread stays behind)."""
    t = threading.Thread(target=fn, name="ft-tp-close", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("tensor parallelism: %s did not finish in %.0f s (a worker rank is gone?)",
                    getattr(fn, "__name__", "a step"), timeout_s)
        return False
    return True


def worker_main(rank: int, config: EngineConfig, port: int) -> None:
    """A worker process: join the group, build this rank, serve rank 0's messages until "stop"."""
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    tp = None
    try:
        from ft.engine.ranks.rank_state import rank_device

        tp = init_group(rank, config.tensor_parallel_size, port, rank_device(config.device, rank))
        worker = TPWorker(config, tp)
    except BaseException as e:  # noqa: BLE001 - told to rank 0 at the startup gather
        traceback.print_exc()
        if tp is not None:
            tp.gather({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    try:
        worker.serve()
    except BaseException:  # noqa: BLE001 - rank 0 sees its collectives fail or time out
        traceback.print_exc()
        os._exit(1)
    if worker.state.runner.graphs is not None:
        worker.state.runner.graphs.release()
    tp.destroy()  # NOTE: while rank 0 leaves too (`Engine.close`): NCCL's teardown waits for its peers
    # NOTE: no interpreter shutdown (library atexit work after the group is gone), but what a normal
    # exit of a multiprocessing child runs: its finalizers (semaphores a library created, e.g.
    # tqdm's lock, are unregistered; else the parent warns of leaked semaphores at exit)
    import multiprocessing.util

    multiprocessing.util._exit_function()
    os._exit(0)


class TPWorker:
    """Rank r > 0: a `RankState` driven by rank 0's messages."""

    def __init__(self, config: EngineConfig, tp: TPGroup) -> None:
        from ft.engine.cache.tp_rebuild import WorkerCache
        from ft.engine.ranks.rank_state import RankState

        self.tp = tp
        self.state = RankState(config, tp)
        self.cache = WorkerCache(self.state.cache, tp.rank, self.state.rungs)
        tp.gather(self.cache.report())  # the startup gather: up (or says why not)

    def serve(self) -> None:
        tp, state = self.tp, self.state
        while True:
            kind, payload = tp.broadcast(None)
            if kind == "step":
                state.runner.execute(payload)
            elif kind == "rebuild":
                tp.gather(self.cache.apply(payload))
            elif kind == "describe":
                tp.gather(self.cache.report())
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"rank {tp.rank}: unknown message {kind!r}")
