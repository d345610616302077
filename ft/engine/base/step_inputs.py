"""What one forward pass reads, as plain Python values: the seam between deciding a step and running it.

The model runner builds a `StepInputs` from the scheduled work (token ids, positions, each
sequence's pages and mamba slot, the decode step's KV slots and lengths, a routing trace's
experts), then loads it into its persistent device buffers. With tensor parallelism rank 0 sends
the same `StepInputs` to every worker rank, which loads it into its own buffers and runs the same
forward over its shard (`ft.engine.ranks.tp_worker`): being plain lists, it pickles small.

`ops` carries what rank 0 did to its pools' contents since the last step outside a forward pass
(a new sequence's zeroed mamba slot, a fork's or a prefix hit's copied page and state, a
relocation's moves: `PoolJournal`), so that every rank's pools hold the same pages and slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInputs:
    """kind "prefill" (any lengths) or "decode" (one token per row, `rows` rows with padding).

    ids, pos: the new tokens and their positions, flattened in sequence order.
    seqs: per row (start, length, pages, mamba_slot).
    logit_index: the flat token index of every logit row the model returns.
    mamba_slots: per row (decode padding rows: -1).
    kv_slots, seq_lens: decode only (padding rows: -1 and the first row's length).
    forced: a routing trace's experts, flat [tokens (+ padding), layers, k] values, or None.
    graph_rows: decode through the CUDA graph of this bucket (None: eager).
    ngram_rows: the n-gram table rows of every token (padding rows zero) where the host reads them from a
    paged table (`FlashNextModel.ngram_reader`), else None.
    """

    kind: str
    ids: list[int]
    pos: list[int]
    seqs: list[tuple[int, int, list[int], int]]
    logit_index: list[int]
    mamba_slots: list[int]
    kv_slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    forced: list[int] | None = None
    calibrate_kv: bool = False
    graph_rows: int | None = None
    real: int = 0  # decode: rows that are sequences (the rest pad to graph_rows)
    ops: list[tuple] = field(default_factory=list)
    ngram_rows: object = None  # [tokens (+ padding), heads * width] CPU tensor: a paged n-gram table's rows, or None


class PoolJournal:
    """The content operations of a KV and a mamba pool, recorded in order (rank 0 under tensor
    parallelism; `replay` applies them to another rank's pools of the same geometry)."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops


def replay_pool_ops(ops: list[tuple], kv, mamba) -> None:
    """Apply `PoolJournal` ops to these pools: ("kv_copy", src, dst), ("mamba_zero", slot),
    ("mamba_copy", src, dst)."""
    for op in ops:
        kind = op[0]
        if kind == "kv_copy":
            for t in kv.tensors:
                t[op[2]].copy_(t[op[1]])
        elif kind == "mamba_zero":
            mamba.zero_slot(op[1])
        elif kind == "mamba_copy":
            mamba.copy_slot(op[1], op[2])
        else:
            raise ValueError(f"unknown pool op {op!r}")
