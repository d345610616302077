"""What one forward pass computes: new tokens of several sequences, flattened."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class SeqSlice:
    """One sequence's part of a batch.

    start: tokens of this sequence already in the caches (position of its first new token).
    length: new tokens in this batch. page_table: [n] int64 KV pages covering start+length.
    mamba_slot: the slot holding its linear-attention state (read, then written back).
    """

    start: int
    length: int
    page_table: torch.Tensor
    mamba_slot: int


@dataclass
class DecodeMeta:
    """What a decode step (one new token per sequence) needs as device tensors, so that the step
    reads no Python value that changes from step to step (a CUDA graph replays it).

    slot_mapping [B] int64: where each new token's K/V goes (page * page_size + offset); -1 for a row
    whose output is never used (a graph bucket's padding, a sequence that already ended): it writes
    nothing, and layers may skip its work (the decode MoE does).
    page_table [B, max_pages] int64: row b lists sequence b's pages (entries past it unused).
    seq_lens [B] int64: tokens of sequence b including the new one.
    max_seq_len: the longest a sequence may get (the context limit), fixed for the run: kernels
    size their split over the context from it, never from the data."""

    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int


@dataclass
class ForwardBatch:
    """input_ids, positions [T] for T = sum of lengths, sequences in order. `decode` is set by
    the model runner for decode steps (every length 1): layers then use its tensors only."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: list[SeqSlice]
    decode: DecodeMeta | None = None
    # a mixed step's leading one-token sequences (the running decodes) as a decode step's tensors, set by the
    # model runner: attention and Gated DeltaNet layers run those rows through the decode kernels (rows
    # 0 .. B-1 of the batch, B = its seq_lens' length); None: every sequence as a prefill
    decode_rows: DecodeMeta | None = None
    # [T, num_moe_layers, top_k] int64: experts chosen for each token instead of the router's top-k
    # (synthetic routing traces for benchmarks, `ft.engine.worker.routing_override`); None: the router's
    forced_experts: torch.Tensor | None = None
    # [T, heads * width] the n-gram table rows of every new token, read by the host from a paged table
    # (`FlashNextModel.ngram_reader`), in a persistent buffer; None: the device gathers them itself
    ngram_rows: torch.Tensor | None = None
    # a decode step whose `ngram_rows` the host fills while the step runs: called on the step's stream just
    # before the rows are read, it makes the stream wait for them there (a graph records the wait;
    # `ft.engine.worker.buffers.RowsBuffer.gate`); None: the rows are in place before the step starts
    ngram_gate: Callable[[], None] | None = None
    # a prefill that sets each quantized KV layer's scales from its own K and V before writing them
    # (`ft.kernels.attention.calibrate_kv_scale`): the first prefill of a cache without scales
    calibrate_kv: bool = False
    # a prefill CUDA graph's capture (`ft.engine.worker.prefill_graphs`): the attention layers hand their
    # cores to it (`pieces.core(...)`) instead of running them; None: eager
    pieces: object | None = None

    @property
    def is_decode(self) -> bool:
        """One token per sequence and no other rows (a padded prefill graph's rows are not decode)."""
        return all(s.length == 1 for s in self.seqs) and self.input_ids.shape[0] == len(self.seqs)

    @cached_property
    def last_token_index(self) -> torch.Tensor:
        """[B] flat index of each sequence's last new token."""
        ends = torch.tensor([s.length for s in self.seqs]).cumsum(0) - 1
        return ends.to(self.input_ids.device)

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[B+1] int32 offsets of the sequences' new tokens (sequence b is tokens cu[b]:cu[b+1]), on the
        device (built once per batch)."""
        lengths = torch.tensor([0] + [s.length for s in self.seqs], dtype=torch.int32)
        return lengths.cumsum(0, dtype=torch.int32).to(self.input_ids.device)

    @cached_property
    def mamba_slots(self) -> torch.Tensor:
        """[B] int64 mamba slot of each sequence, on the device (built once per batch)."""
        return torch.tensor([s.mamba_slot for s in self.seqs], device=self.input_ids.device)
