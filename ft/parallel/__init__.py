"""Tensor parallelism over `torch.distributed`: the process group of the ranks that share one
model (`TPGroup`) and how a checkpoint is cut for each of them (`ft.model.tp_shard`).

Rank 0 runs the engine (scheduler, sampler, HTTP server); every other rank runs a worker
(`ft.engine.ranks.tp_worker`) that receives each step's inputs and pool operations from rank 0 and runs
the same forward over its own shard, its own pools and its own expert cache. Activations are
summed across ranks with all-reduces (NCCL on CUDA, gloo on the CPU).
"""

from ft.parallel.group import TPGroup, free_port, init_group

__all__ = ["TPGroup", "free_port", "init_group"]
