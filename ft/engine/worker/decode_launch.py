"""Overlapped decode's steps on the device (details module of `ft.engine.worker.model_runner`): a decode
step queued without waiting for its tokens, its inputs gathered on the device from the step queued
before it (`DecodeLauncher`), and what the engine keeps of a queued step (`LaunchedDecode`).

The host staging of a step's inputs is rewritten by the next step: a plain step may, since each
step ends with a wait; a queued one has not ended. So every launch records an event after its
host-to-device copies (the sampling parameters are staged before the forward for this), and the
next launch, or a plain step, waits for it before it writes the staging again: by then the copies
have long run (they precede the forward), so the wait is short.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ft.engine.sampling.sampler import sample
from ft.engine.base.sequence import Sequence
from ft.model.forward_batch import ForwardBatch


@dataclass
class LaunchedDecode:
    """A decode step queued by `DecodeLauncher.launch`: its rows' sequences, the sampled ids [rows]
    on the device, and their copy to the host (`ResultCopy.start`)."""

    seqs: list[Sequence]
    sampled: torch.Tensor
    copy: tuple


class DecodeLauncher:
    """The overlapped steps of one `ft.engine.worker.model_runner.ModelRunner` (`runner`: it builds their
    inputs, runs their forward and samples as for a plain step)."""

    def __init__(self, runner) -> None:
        # NOTE: a weak reference: no cycle through the runner, whose pools go with it when dropped
        self.runner = weakref.proxy(runner)
        self._staged: torch.cuda.Event | None = None  # after the last launch's host-to-device copies
        self.rows_after_launch = 0  # steps whose n-gram rows were read after their graph's launch (tests, reports)

    def wait_staged(self) -> None:
        """The last launch's host-to-device copies have read their staging."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None

    def launch(self, seqs: list[Sequence], after: LaunchedDecode | None) -> LaunchedDecode:
        """Queue a decode step of `seqs` (one token each, greedy or sampled, no penalties, logprobs
        or grammar) and return without waiting for it: `finish` reads its tokens.

        `after`: the step still in flight whose sampled tokens are these rows' inputs (each of
        `seqs` was one of its rows): they are gathered on the device, never read by the host first;
        a row whose input is one of its sequence's stop tokens (that sequence ended) computes
        without writing anything (KV slot and state slot -1, as padding rows), so that its cache
        stays the state after its last token. Positions are each sequence's num_computed, which
        must count the steps queued before this one (the caller advances it after each launch).
        Single process only (no tensor parallelism)."""
        r = self.runner
        self.wait_staged()
        r.clear_logit_plan()
        n = r.graph_rows_for(len(seqs))
        inp = r.decode_inputs(seqs, n or len(seqs), n, ids_on_device=after is not None)
        batch_s = r.sampling(seqs, ahead=1 if after is not None else 0)  # staged before the forward
        feed = self._feed(seqs, after, len(inp.ids)) if after is not None else None
        cuda = r.device.type == "cuda"
        rows_of = None if after is None or r.ngram_rows is None else {id(s): j for j, s in enumerate(after.seqs)}

        def ngram_rows() -> torch.Tensor:
            # NOTE: the one wait for the step in flight, as late as it can come: this step's inputs are
            # staged and its expert policy has run (`begin_step`) while `after` computed
            tokens = r.results.take(after.copy)
            return r.decode_ngram_rows(seqs, [tokens[rows_of[id(s)]] for s in seqs], len(inp.ids))

        def before_forward(batch: ForwardBatch, replays: bool):
            staged_after = None
            if rows_of is not None:  # a paged n-gram table: the host reads the rows of `after`'s tokens
                if batch.ngram_gate is None:
                    batch.ngram_rows = r.ngram_rows.load(ngram_rows())
                elif replays:  # read once this step's graph is launched: it waits for them at the table's layer
                    def staged_after() -> None:
                        self.rows_after_launch += 1
                        r.ngram_rows.stage(ngram_rows)
                else:  # (an eager step, or the one a capture follows: nothing may wait on the host there)
                    r.ngram_rows.stage(ngram_rows)
            if feed is not None:
                rows, stops, width = feed
                ids = after.sampled.index_select(0, rows)
                batch.input_ids.copy_(ids)
                real = len(seqs)
                dead = (ids[:real, None] == stops.view(real, width)).any(dim=1)
                batch.decode.slot_mapping[:real].masked_fill_(dead, -1)
                batch.mamba_slots[:real].masked_fill_(dead, -1)
            if cuda:
                self._staged = torch.cuda.Event()
                self._staged.record()
            return staged_after

        logits = r.execute_local(inp, before_forward)
        sampled = sample(logits, batch_s)
        r.count_resident_hits(len(seqs))
        r.last_logits = logits
        r.last_logprobs, r.last_prompt_logprobs = [None] * len(seqs), []
        return LaunchedDecode(list(seqs), sampled, r.results.start(sampled))

    def finish(self, launched: LaunchedDecode) -> list[int]:
        """The tokens of a launched step, one per sequence (waits for that step)."""
        return self.runner.results.take(launched.copy)

    def _feed(self, seqs: list[Sequence], after: LaunchedDecode, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(each row's row in `after` [rows] (padding rows: the first's), the real rows' stop token
        ids [real * width] (-1 pads: no token), width) in the runner's sample buffers."""
        at = {id(s): j for j, s in enumerate(after.seqs)}
        index = [at[id(s)] for s in seqs]
        index += [index[0]] * (rows - len(seqs))
        width = max(1, max(len(s.stop_token_ids) for s in seqs))
        stops = [t for s in seqs for t in (sorted(s.stop_token_ids) + [-1] * (width - len(s.stop_token_ids)))]
        sb = self.runner.sample_buffers
        return sb["feed_rows"].load(index), sb["feed_stops"].load(stops), width
