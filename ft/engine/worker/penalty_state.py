"""The sampler's penalty state: per-sequence token counts kept on the device (`PenaltyState`)."""

from __future__ import annotations

import torch

from ft.engine.worker.buffers import StagedBuffer
from ft.engine.base.sequence import Sequence


class PenaltyState:
    """Token counts of the sequences that sample with penalties, kept on the device from step to
    step: counts [S, V] int32 (each token's count among the generated tokens) and in_prompt [S, V]
    bool (the prompt's tokens, filled for a repetition penalty only), one slot per sequence. A slot
    is taken at the sequence's first penalised step (filled from its ids then, once) and freed
    lazily once the sequence has finished; a preempted sequence keeps its slot (its generated
    tokens stay). A step gathers its penalised rows (one index_select) and adds the tokens it
    sampled (one index_put): no host work that grows with the sequences' lengths.

    Why a table rather than scattering counts from the token ids at every step: the table costs
    the same whatever the lengths, while rebuilding sends and scatters every generated token of
    every penalised row at every step (quadratic over a generation). Measured on one CPU thread,
    V = 151936, 8 rows: 0.13 ms per step with the table; rebuilding from the ids took 0.3 / 3.9 /
    33 ms at 100 / 2000 / 16000 tokens per row. Memory: 5 bytes x V per slot (0.76 MB at V =
    151936), for max_running_requests slots, allocated at the first penalised request only (more
    when preempted sequences keep theirs while others run).
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device, self.capacity = device, max(1, capacity)
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._holders: list[Sequence | None] = []
        self._slot: dict[int, int] = {}  # id(sequence) -> slot (the holder list keeps it alive)
        self._bufs = {name: StagedBuffer(self.capacity, torch.int64, device)
                      for name in ("slots", "new", "prompt_slot", "prompt_ids", "out_slot", "out_ids")}

    def slots(self, seqs: list[Sequence], vocab: int) -> torch.Tensor:
        """The slots of `seqs` [R] int64 on the device; new ones are taken and filled."""
        if self.counts is None or self.counts.shape[1] != vocab:
            self._resize(self.capacity, vocab, keep=False)
        new = [s for s in seqs if id(s) not in self._slot]
        if new:
            free = self._free()
            if len(free) < len(new):
                self._resize(len(self._holders) + len(new) - len(free), vocab, keep=True)
                free = self._free()
            for seq, slot in zip(new, free):
                old = self._holders[slot]
                if old is not None:
                    del self._slot[id(old)]
                self._holders[slot] = seq
                self._slot[id(seq)] = slot
            self._fill(new)
        return self._bufs["slots"].load([self._slot[id(s)] for s in seqs])

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one more occurrence of tokens[r] in slot slots[r]."""
        self.counts.index_put_((slots, tokens), self._one.expand(slots.shape[0]), accumulate=True)

    def slot_of(self, seq: Sequence) -> int | None:
        """The slot `seq` holds, if any (tests)."""
        return self._slot.get(id(seq))

    @property
    def num_held(self) -> int:
        """Slots held by sequences that have not finished (tests)."""
        return sum(1 for h in self._holders if h is not None and not h.is_finished)

    def _free(self) -> list[int]:
        return [i for i, h in enumerate(self._holders) if h is None or h.is_finished]

    def _resize(self, slots: int, vocab: int, keep: bool) -> None:
        n = max(slots, 2 * len(self._holders)) if keep else slots
        counts = torch.zeros(n, vocab, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(n, vocab, dtype=torch.bool, device=self.device)
        if keep:
            old = len(self._holders)
            counts[:old], in_prompt[:old] = self.counts, self.in_prompt
            self._holders += [None] * (n - old)
        else:
            self._holders, self._slot = [None] * n, {}
        self.counts, self.in_prompt = counts, in_prompt
        self._one = torch.ones(1, dtype=torch.int32, device=self.device)
        self._true = torch.ones(1, dtype=torch.bool, device=self.device)

    def _fill(self, seqs: list[Sequence]) -> None:
        """Counts of the sequences' generated tokens so far, their prompt tokens (a repetition
        penalty only): each staging buffer loaded once (a later load would overwrite the host
        staging before the device has read it)."""
        slots = [self._slot[id(s)] for s in seqs]
        new = self._bufs["new"].load(slots)
        self.counts.index_fill_(0, new, 0)
        self.in_prompt.index_fill_(0, new, False)
        ps, pi, os_, oi = [], [], [], []
        for seq, slot in zip(seqs, slots):
            if seq.params.repetition_penalty != 1.0:
                ps += [slot] * len(seq.prompt_ids)
                pi += seq.prompt_ids
            os_ += [slot] * len(seq.output_ids)
            oi += seq.output_ids
        b = self._bufs
        if pi:
            self.in_prompt.index_put_((b["prompt_slot"].load(ps), b["prompt_ids"].load(pi)), self._true.expand(len(pi)))
        if oi:
            self.counts.index_put_((b["out_slot"].load(os_), b["out_ids"].load(oi)), self._one.expand(len(oi)),
                                   accumulate=True)
