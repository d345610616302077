"""The model runner: scheduled work in, one sampled token per finished sequence out.

It prepares the batch for the model in persistent device buffers, runs it over the pools, and
samples on the device. `Engine.step` only sees `run(work) -> token ids`; where the batch lives
and how it is sampled (and later, which CUDA graph replays it) is this module's business.

Buffers: every input of a step (token ids, positions, sequence lengths, last-token indices,
mamba slots, the page table, the sampling parameters) lives in a device tensor allocated once,
sized for the largest batch, with a host staging twin (pinned on CUDA). A step writes its values
into the host prefix and copies that prefix to the device in one copy per buffer, so the
addresses the model reads stay fixed from step to step (what a CUDA graph capture needs). The
`ForwardBatch` the model gets is made of views of these buffers.

Sampling extras (min-p, penalties, logit bias, logprobs, prompt logprobs) have buffers of their own
(`sample_buffers`), loaded only on the steps that use them: the decode graphs never read them, so
they stay out of the graphs' key and may grow without a recapture. Logprobs come back to the host
in the same single copy as the sampled tokens (`result_copy.ResultCopy`).
"""

from __future__ import annotations

import logging

import torch

from ft.engine.worker.buffers import RowsBuffer, PageTableBuffer, StagedBuffer, StagingArena
from ft.engine.worker.decode_graphs import DecodeGraphs
from ft.engine.worker.decode_launch import DecodeLauncher
from ft.engine.worker.prefill_graphs import PrefillGraphs, padded_inputs
from ft.engine.text.grammar import GrammarMaskBuffer
from ft.engine.sampling.logit_plan import LogitPlan, logprob_entry
from ft.engine.worker.penalty_state import PenaltyState
from ft.engine.worker.result_copy import ResultCopy
from ft.engine.sampling.sampler import GrammarMask, LogitBias, Penalties, SamplingBatch, logprobs_of, sample
from ft.engine.base.sampling_params import TokenLogprob
from ft.kernels.backend import debug_checks
from ft.kernels.moe import runs_triton
from ft.engine.sched.scheduler import ScheduledWork
from ft.engine.base.step_inputs import PoolJournal, StepInputs, replay_pool_ops
from ft.engine.base.sequence import Sequence
from ft.memory.cache_pools import CachePools
from ft.model.forward_batch import DecodeMeta, ForwardBatch, SeqSlice
from ft.errors import RanksOutOfStep

_log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the step's device buffers; `run(work)` is one forward pass and one sampling.

    Sizes: up to `max_running_requests` sequences, `max(max_prefill_length, max_running_requests)`
    tokens and `max_pages_per_seq` KV pages per sequence (ceil(context_limit / page_size)); the
    defaults start at one and grow with the first batches.
    """

    def __init__(
        self,
        model,
        pools: CachePools,
        device: torch.device,
        max_running_requests: int = 1,
        max_prefill_length: int = 1,
        max_pages_per_seq: int = 1,
        max_seq_len: int = 1,
        cuda_graph_max_bs: int = 0,
        prefill_graph_max_tokens: int = 0,
        cuda_graph_bs: tuple[int, ...] | None = None,
    ) -> None:
        self.model, self.pools, self.device = model, pools, device
        self.max_seq_len = max_seq_len
        # decode steps replay CUDA graphs on CUDA unless disabled (cuda_graph_max_bs 0)
        bs = min(cuda_graph_max_bs, max_running_requests)
        # NOTE: FT_DEBUG's checks read device values on the host, which a graph capture forbids
        self.graphs = DecodeGraphs(bs, pdl=model.decode_graph_pdl, sizes=cuda_graph_bs) \
            if device.type == "cuda" and bs > 0 and not debug_checks() else None
        rows, tokens = max_running_requests, max(max_prefill_length, max_running_requests)
        # one-sequence prefills of up to this many tokens replay CUDA graphs padded to a bucket
        pg = min(prefill_graph_max_tokens, max_prefill_length)
        cfg = getattr(model, "cfg", None)
        self.prefill_graphs = PrefillGraphs(pg, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                            model.dtype, device) \
            if device.type == "cuda" and pg > 0 and cfg is not None and not debug_checks() else None
        i64, f32 = torch.int64, torch.float32
        self.buffers: dict[str, StagedBuffer] = {
            name: StagedBuffer(n, dtype, device) for name, n, dtype in (
                ("input_ids", tokens, i64), ("positions", tokens, i64), ("cu_seqlens", rows + 1, torch.int32),
                ("last_token_index", rows, i64), ("mamba_slots", rows, i64),
                ("mixed_slot_mapping", rows, i64), ("mixed_seq_lens", rows, i64),
                ("temperature", rows, f32), ("top_k", rows, i64), ("top_p", rows, f32), ("uniform", rows, f32),
            )
        }
        # NOTE: sampling's and prompt logprobs' inputs, never read by the decode graphs (which read the
        # decode buffers below, the page table and `forced_experts`: the addresses that key them)
        self.sample_buffers: dict[str, StagedBuffer] = {
            name: StagedBuffer(n, dtype, device) for name, n, dtype in (
                ("min_p", rows, f32), ("pen_rows", rows, i64), ("pen_rep", rows, f32), ("pen_pres", rows, f32),
                ("pen_freq", rows, f32), ("bias_rows", rows, i64), ("bias_tokens", rows, i64),
                ("bias_values", rows, f32), ("lp_rows", rows, i64), ("logit_index", tokens, i64),
                ("sample_rows", rows, i64), ("prompt_rows", tokens, i64), ("prompt_targets", tokens, i64),
                ("grammar_rows", rows, i64), ("feed_rows", rows, i64), ("feed_stops", rows, i64),
            )
        }
        self.grammar_masks = GrammarMaskBuffer(device)  # the bitmasks of the rows with a grammar
        self.penalties = PenaltyState(device, rows)
        self._pen_slots: torch.Tensor | None = None  # this step's penalty slots (set by `sampling`)
        self._plan: LogitPlan | None = None  # set by `prepare` when prompt positions need logits
        # of the last step, per sequence of its work: the sampled token's logprobs (None where not
        # asked or no token) and the prompt logprobs computed (sequence, first position, entries)
        self.last_logprobs: list[TokenLogprob | None] = []
        self.last_prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprob]]] = []
        # a decode step's inputs (one token per sequence) reach the device in one copy: its buffers
        # and the page table's staging are regions of one arena (prefill uses `self.buffers`)
        decode_specs = [(name, rows, i64) for name in ("input_ids", "positions", "seq_lens", "last_token_index",
                                                       "mamba_slots", "slot_mapping")]
        self.decode_arena = StagingArena([n * 8 for _, n, _ in decode_specs]
                                         + [PageTableBuffer.arena_bytes(rows, max_pages_per_seq)], device)
        self.decode_buffers: dict[str, StagedBuffer] = {
            name: StagedBuffer(n, dtype, device, arena=(self.decode_arena, i))
            for i, (name, n, dtype) in enumerate(decode_specs)
        }
        self.page_table = PageTableBuffer(rows, max_pages_per_seq, device, arena=(self.decode_arena, len(decode_specs)))
        self.routing = None  # a `routing_override.TraceRouting` (synthetic traces): set by the engine
        # a paged n-gram table's rows, read by the host for each step (`ft.model.paged_table`): every token of
        # a chunk and a step's decoding rows
        rows_shape = RowsBuffer.shape_for(model, tokens + rows)  # (its bytes: `RowsBuffer.device_bytes`, budgeted)
        self.ngram_rows = None if rows_shape is None else RowsBuffer(*rows_shape, device)
        # a mixed step's decoding rows as one decode batch (`_decode_rows`); off: each a one-token prefill (the
        # former path, for A/Bs: bench/prefill.py --decoding-rows-as)
        self.mixed_decode_rows = True
        self.results = ResultCopy(rows, device)  # the sampled ids (and logprobs) to the host, one copy a step
        self.launcher = DecodeLauncher(self)  # overlapped decode's steps (`ft.engine.worker.decode_launch`)
        self.last_logits: torch.Tensor | None = None  # [B, V] of the last step (tests and debugging)
        # tensor parallelism (`ft.parallel.TPGroup`): rank 0 sends each step's inputs with the
        # journal of its pools' content operations (`attach_tp`)
        self.tp = None
        self.journal: PoolJournal | None = None

    def attach_tp(self, tp) -> None:
        """Run as a rank of tensor-parallel group `tp`: rank 0 records its pools' content operations
        and sends them with each step; the others receive (`ft.engine.ranks.tp_worker`)."""
        self.tp = tp
        if tp.is_leader:
            self.journal = PoolJournal()
            self.pools.kv.journal = self.pools.mamba.journal = self.journal

    # ------------------------------------------------------------------------------- inputs
    def prepare(self, work: ScheduledWork) -> ForwardBatch:
        """The batch of `work` as views of the persistent buffers."""
        return self.load(self._prefill_inputs(work))

    def _prefill_inputs(self, work: ScheduledWork) -> StepInputs:
        """`work` as plain values; when prompt positions need logits, also the sampling plan
        (`self._plan`, rank 0's business only)."""
        ids: list[int] = []
        pos: list[int] = []
        last = []
        # prompt logprobs: the logits of every position of a chunk whose next tokens are prompt tokens
        index, sample_rows, prompt_rows, targets, spans = [], [], [], [], []
        for seq, n in zip(work.seqs, work.num_tokens):
            start = seq.num_computed
            base = len(ids)
            ids.extend(_tokens(seq, start, n))
            pos.extend(range(start, start + n))
            last.append(len(ids) - 1)
            # positions start..start+m-1 predict prompt tokens start+1..start+m
            m = min(start + n, len(seq.prompt_ids) - 1) - start if seq.needs_prompt_logits else 0
            if m > 0:
                first = len(index)
                index.extend(range(base, base + n))
                prompt_rows.extend(range(first, first + m))
                targets.extend(seq.prompt_ids[start + 1 : start + 1 + m])
                spans.append((seq, start + 1, m))
            else:
                index.append(base + n - 1)
            sample_rows.append(len(index) - 1)
        if spans:  # the model returns the logits of `index` (every position of those chunks)
            sb = self.sample_buffers
            self._plan = LogitPlan(sb["sample_rows"].load(sample_rows), sb["prompt_rows"].load(prompt_rows),
                                    sb["prompt_targets"].load(targets), spans)
        ngram = None
        if self.ngram_rows is not None:  # (a paged n-gram table: the host reads the rows)
            spans, ahead, at = [], [], 0
            for seq, n in zip(work.seqs, work.num_tokens):
                spans.append((self._ngram_context(seq, seq.num_computed), ids[at: at + n]))
                at += n
                nxt = seq.num_computed + n  # a prompt that goes on: its next chunk, read while this one computes
                if n > 1 and nxt < len(seq.prompt_ids):
                    ahead.append((self._ngram_context(seq, nxt), seq.prompt_ids[nxt: nxt + n]))
            reader = self.model.ngram_reader
            ngram = reader.rows(spans)
            reader.read_ahead(ahead)
        return StepInputs(
            "prefill", ids, pos, [(seq.num_computed, n, seq.pages, seq.mamba_slot)
                                  for seq, n in zip(work.seqs, work.num_tokens)],
            index if spans else last, [seq.mamba_slot for seq in work.seqs],
            forced=self.routing and self.routing.step_values([s.request_id for s in work.seqs], list(work.num_tokens)),
            ngram_rows=ngram,
        )

    def _ngram_context(self, seq: Sequence, start: int) -> list[int]:
        """The n-gram context of a sequence's token at `start`: the ids before it, the EOS id where there are none."""
        hs = self.model.hashing
        before = _tokens(seq, max(0, start - hs.context_len), min(start, hs.context_len))
        return [hs.eos_token_id] * (hs.context_len - len(before)) + before

    def load(self, inp: StepInputs) -> ForwardBatch:
        """`inp` in the persistent buffers, as the `ForwardBatch` the model reads. A decode step's
        inputs travel in one copy (the decode arena's flush, queued last)."""
        d = inp.kind == "decode"
        buf = self.decode_buffers if d else self.buffers
        if d:
            table = self.page_table.load_rows([pages for _, _, pages, _ in inp.seqs], defer=True)
            slices = [SeqSlice(start, 1, table[i], slot) for i, (start, _, _, slot) in enumerate(inp.seqs)]
        else:
            tables = self.page_table.load([pages for _, _, pages, _ in inp.seqs])
            slices = [SeqSlice(start, n, t, slot) for (start, n, _, slot), t in zip(inp.seqs, tables)]
        batch = ForwardBatch(buf["input_ids"].load(inp.ids, d), buf["positions"].load(inp.pos, d), slices)
        if not d:
            batch.decode_rows = self._decode_rows(inp)
        # NOTE: these are cached properties of ForwardBatch: set here, they are buffer views.
        if d:
            batch.decode = DecodeMeta(buf["slot_mapping"].load(inp.kv_slots, d), table,
                                      buf["seq_lens"].load(inp.seq_lens, d), self.max_seq_len)
        if len(inp.logit_index) == len(inp.seqs):
            batch.last_token_index = buf["last_token_index"].load(inp.logit_index, d)
        else:  # every position of some chunks (prompt logprobs)
            batch.last_token_index = self.sample_buffers["logit_index"].load(inp.logit_index)
        batch.mamba_slots = buf["mamba_slots"].load(inp.mamba_slots, d)
        if not d:  # NOTE: a persistent buffer, not the batch's own tensor: the prefill graphs read it
            cu = [0]
            for _, n, _, _ in inp.seqs:
                cu.append(cu[-1] + n)
            batch.cu_seqlens = buf["cu_seqlens"].load(cu)
        batch.forced_experts = self._load_forced(inp.forced)
        if d and self.ngram_rows is not None and self.ngram_rows.gated:  # (`RowsBuffer`: rows staged, not copied)
            batch.ngram_rows, batch.ngram_gate = self.ngram_rows.gated_view(len(inp.ids))
            if inp.ngram_rows is not None:
                self.ngram_rows.stage(inp.ngram_rows)
        elif inp.ngram_rows is not None:
            batch.ngram_rows = self.ngram_rows.load(inp.ngram_rows)
        batch.calibrate_kv = inp.calibrate_kv
        if d:
            self.decode_arena.flush()
        return batch

    def _decode_rows(self, inp: StepInputs) -> DecodeMeta | None:
        """A mixed step's leading one-token sequences (the running decodes: the scheduler puts them first) as a
        decode step's tensors over the page table's first rows (`load` just wrote them), so that attention
        and Gated DeltaNet layers run them through the decode kernels, one launch for all, instead of one
        prefill attention each (whose long-prefix path gathers each row's whole prefix) and one chunked
        sequence each; None for a step of one sequence (prefill graphs hold one) or without such rows."""
        rows = 0
        for _, n, _, _ in inp.seqs:
            if n != 1:
                break
            rows += 1
        if not rows or len(inp.seqs) < 2 or not self.mixed_decode_rows:
            return None
        page = self.pools.kv.page_size
        heads = inp.seqs[:rows]
        slots = [pages[start // page] * page + start % page for start, _, pages, _ in heads]
        lengths = [start + 1 for start, _, _, _ in heads]
        return DecodeMeta(self.buffers["mixed_slot_mapping"].load(slots), self.page_table.table[:rows],
                          self.buffers["mixed_seq_lens"].load(lengths), self.max_seq_len)

    def _load_forced(self, values: list[int] | torch.Tensor | None) -> torch.Tensor | None:
        """A step's traced experts (`TraceRouting.step_values`: a list, or a tensor drawn on this device)
        in a persistent buffer, [T, layers, k]."""
        r = self.routing
        if values is None or r is None:
            return None
        per_token = r.num_layers * r.top_k
        buf = self.buffers.get("forced_experts")
        if buf is None:
            buf = self.buffers["forced_experts"] = StagedBuffer(self.buffers["input_ids"].capacity * per_token,
                                                                torch.int64, self.device)
        return buf.load(values).view(-1, r.num_layers, r.top_k)

    def sampling(self, seqs: list[Sequence], done: list[bool] | None = None, vocab: int | None = None,
                 ahead: int = 0) -> SamplingBatch:
        """The rows' sampling parameters in the buffers; step = tokens generated so far (plus `ahead`:
        tokens sampled by steps still in flight). Penalties, logit biases and grammar bitmasks are
        loaded for the rows in `done` only (the others' tokens are discarded: their counts must not
        change); `vocab` (V) sizes the penalty state."""
        done = [True] * len(seqs) if done is None else done
        params = [s.params for s in seqs]
        rows = [SamplingBatch.row(p, s.seed, len(s.output_ids) + ahead) for p, s in zip(params, seqs)]
        temp, top_k, top_p, min_p, uniform = (list(c) for c in zip(*rows))
        all_greedy, any_filter, any_min_p = SamplingBatch.flags(params)
        buf, sb = self.buffers, self.sample_buffers
        batch = SamplingBatch(
            buf["temperature"].load(temp), buf["top_k"].load(top_k), buf["top_p"].load(top_p),
            buf["uniform"].load(uniform), all_greedy, any_filter, sb["min_p"].load(min_p) if any_min_p else None,
        )
        self._pen_slots = None
        pen = [i for i, (p, d) in enumerate(zip(params, done)) if d and p.has_penalties]
        if pen:
            pp = [params[i] for i in pen]
            state = self.penalties
            self._pen_slots = slots = state.slots([seqs[i] for i in pen], vocab)
            any_rep = any(p.repetition_penalty != 1.0 for p in pp)
            batch.penalties = Penalties(
                sb["pen_rows"].load(pen), state.counts.index_select(0, slots),
                state.in_prompt.index_select(0, slots) if any_rep else None,
                sb["pen_rep"].load([p.repetition_penalty for p in pp]),
                sb["pen_pres"].load([p.presence_penalty for p in pp]),
                sb["pen_freq"].load([p.frequency_penalty for p in pp]),
            )
        bias = [(i, t, v) for i, (p, d) in enumerate(zip(params, done)) if d for t, v in p.logit_bias]
        if bias:
            r, t, v = zip(*bias)
            batch.bias = LogitBias(sb["bias_rows"].load(r), sb["bias_tokens"].load(t), sb["bias_values"].load(v))
        # structured output: the host-side matchers fill their rows' bitmasks, one non-blocking copy
        gram = [i for i, (s, d) in enumerate(zip(seqs, done)) if d and s.grammar is not None]
        if gram:
            matchers = [seqs[i].grammar for i in gram]
            batch.grammar = GrammarMask(sb["grammar_rows"].load(gram),
                                        self.grammar_masks.load(matchers, matchers[0].words))
        return batch

    # ------------------------------------------------------------------------------- step
    def prepare_decode(self, seqs: list[Sequence], n: int) -> ForwardBatch:
        """A decode batch (one new token per sequence) padded to n rows with copies of the first
        sequence, every input in the persistent buffers, `decode` set: the forward then reads
        device tensors only (what a CUDA graph replays)."""
        return self.load(self.decode_inputs(seqs, n))

    def decode_inputs(self, seqs: list[Sequence], n: int, graph_rows: int | None = None,
                       ids_on_device: bool = False) -> StepInputs:
        """ids_on_device: the token ids are not known on the host yet (overlapped decode: zeros here,
        gathered on the device from the step in flight, `ft.engine.worker.decode_launch`); the positions
        are each sequence's num_computed, which counts the steps launched."""
        real = len(seqs)
        rows = list(seqs) + [seqs[0]] * (n - real)
        page = self.pools.kv.page_size
        pos = [s.num_computed for s in rows]
        # NOTE: padding rows read like the first sequence but write nowhere (slot -1): the fused
        # kernels update states in place, so two rows must never share a slot they write
        kv_slots = [s.pages[p // page] * page + p % page for s, p in zip(seqs, pos)]
        ids = [0] * n if ids_on_device else [_tokens(s, p, 1)[0] for s, p in zip(rows, pos)]
        # a paged n-gram table's rows: read here from the ids, or (ids on the device) fed by the overlapped launch
        # once the step in flight has sampled them (`DecodeLauncher.launch`, `decode_ngram_rows`)
        ngram = None if self.ngram_rows is None or ids_on_device else self.decode_ngram_rows(seqs, ids, n)
        return StepInputs(
            "decode", ids, pos,
            [(p, 1, s.pages, s.mamba_slot) for s, p in zip(rows, pos)], list(range(n)),
            [s.mamba_slot for s in seqs] + [-1] * (n - real), kv_slots + [-1] * (n - real), [p + 1 for p in pos],
            self.routing and self.routing.step_values([s.request_id for s in seqs], [1] * real, pad=n - real),
            graph_rows=graph_rows,
            real=real,
            ngram_rows=ngram,
        )

    def decode_ngram_rows(self, seqs: list[Sequence], ids: list[int], n: int) -> torch.Tensor:
        """A decode step's paged n-gram table rows [n, heads * width] (CPU): each sequence's new token `ids[i]`
        at its position num_computed, with the ids before it as its context; padding rows zero."""
        real = self.model.ngram_reader.rows([(self._ngram_context(s, s.num_computed), [i]) for s, i in zip(seqs, ids)])
        return real if n == len(seqs) else torch.cat([real, real.new_zeros(n - len(seqs), real.shape[1])])

    def run(self, work: ScheduledWork) -> list[int | None]:
        """One forward pass over `work`; for each sequence the sampled token, or None when its
        part was a chunk of a longer prompt (no token yet). The logprobs that sequences asked for
        are left in `last_logprobs` and `last_prompt_logprobs`."""
        self._plan = None
        self.launcher.wait_staged()  # (an overlapped launch's staging, before this step rewrites it)
        kv = self.pools.kv
        if not work.is_prefill and all(n == 1 for n in work.num_tokens):
            n = self.graph_rows_for(len(work.seqs))
            inp = self.decode_inputs(work.seqs, n or len(work.seqs), n)
            done = [True] * len(work.seqs)
        else:
            inp = self._prefill_inputs(work)
            inp.calibrate_kv = kv.calibrate_next_prefill
            done = [seq.num_computed + n >= seq.num_tokens for seq, n in zip(work.seqs, work.num_tokens)]
        logits = self.execute(inp)  # [B, V] float32 ([N, V] with a plan)
        if inp.calibrate_kv:
            kv.calibrate_next_prefill = False
            _log.info("KV scales set from the first prefill (K, V per full-attention layer): %s",
                      [tuple(round(v, 6) for v in row) for row in kv.scales.tolist()])
        plan, self._plan = self._plan, None
        every = logits
        if plan is not None:  # the sequences' last positions, among every position computed
            logits = every.index_select(0, plan.sample_rows)
        self.count_resident_hits(sum(work.num_tokens))
        self.last_logits = logits
        self.last_logprobs = [None] * len(done)
        self.last_prompt_logprobs = []
        if not any(done) and plan is None:  # chunks of longer prompts only
            self._wait()
            return [None] * len(done)
        sampled, lp_rows, k = None, [], 0
        extras: list[torch.Tensor] = []  # device tensors that travel with the tokens
        if any(done):
            sampled, lp_rows, k, extras = self._sample(logits, work.seqs, done)
        if plan is not None:
            kp = max(seq.params.prompt_logprobs for seq, _, _ in plan.spans)
            extras += logprobs_of(every.index_select(0, plan.prompt_rows), plan.prompt_targets, kp)
        if self.routing is not None:  # NOTE: while the device works: the next step's traced experts
            self.routing.prefetch([s.request_id for s, d in zip(work.seqs, done) if d])
        tokens, values = self._to_host(sampled, extras)
        if lp_rows:
            own, top_v, top_i = values[:3]
            values = values[3:]
            for j, i in enumerate(lp_rows):
                kk = work.seqs[i].params.logprobs
                self.last_logprobs[i] = logprob_entry(tokens[i], own, top_v, top_i, j, k, kk)
        if plan is not None:
            own, top_v, top_i = values
            j = 0
            for seq, first, m in plan.spans:
                kk = seq.params.prompt_logprobs
                entries = [logprob_entry(seq.prompt_ids[first + q], own, top_v, top_i, j + q, kp, kk) for q in range(m)]
                self.last_prompt_logprobs.append((seq, first, entries))
                j += m
        if sampled is None:
            return [None] * len(done)
        return [t if d else None for t, d in zip(tokens, done)]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], done: list[bool]
                ) -> tuple[torch.Tensor, list[int], int, list[torch.Tensor]]:
        """Sample every row of `logits` [B, V] (row i: seqs[i]; rows not `done` are discarded) and
        queue the logprobs asked for: (sampled [B] on the device, the rows with logprobs, their
        largest k, the logprob tensors that travel with the tokens to the host)."""
        batch = self.sampling(seqs, done, logits.shape[-1])
        sampled = sample(logits, batch)
        if batch.penalties is not None:  # the penalty state counts the new tokens
            self.penalties.record(self._pen_slots, sampled.index_select(0, batch.penalties.rows))
        lp_rows = [i for i, (s, d) in enumerate(zip(seqs, done)) if d and s.params.logprobs is not None]
        k, extras = 0, []
        if lp_rows:
            k = max(seqs[i].params.logprobs for i in lp_rows)
            rows = None if len(lp_rows) == len(done) else self.sample_buffers["lp_rows"].load(lp_rows)
            sel = logits if rows is None else logits.index_select(0, rows)
            extras = list(logprobs_of(sel, sampled if rows is None else sampled.index_select(0, rows), k))
        return sampled, lp_rows, k, extras

    def sample_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per sequence from given logits rows (row i for seqs[i]), sampled exactly as `run`
        samples a step's rows (parameters, seed and step, penalties, logprobs): the first tokens of
        the n > 1 siblings that fork from their parent's prompt prefill (`Engine.add_request_group`),
        from the parent's last-position row. Returns the tokens and their logprobs (None where not
        asked). Call it between steps (after `run`): it reuses the step's staging buffers."""
        sampled, lp_rows, k, extras = self._sample(logits, seqs, [True] * len(seqs))
        tokens, values = self._to_host(sampled, extras)
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if lp_rows:
            own, top_v, top_i = values[:3]
            for j, i in enumerate(lp_rows):
                out[i] = logprob_entry(tokens[i], own, top_v, top_i, j, k, seqs[i].params.logprobs)
        return tokens, out

    def execute(self, inp: StepInputs) -> torch.Tensor | None:
        """The forward pass of `inp` on this rank: logits [rows, V] float32 (decode: the real rows),
        None on a tensor-parallel worker. Rank 0 of a tensor-parallel engine first sends `inp`,
        with its pools' content operations since the last step, to the workers; a worker replays
        those operations before its forward."""
        tp = self.tp
        if tp is not None and tp.is_leader:
            inp.ops = self.journal.take()
            if isinstance(inp.forced, torch.Tensor):  # traced routing drawn on the device: the workers get numbers
                inp.forced = inp.forced.tolist()
            tp.broadcast(("step", inp))
            try:
                return self.execute_local(inp)
            except Exception as e:
                raise RanksOutOfStep(f"rank 0 failed a step the workers had started ({type(e).__name__}: {e}); "
                                     "the ranks are out of step: restart ft serve") from e
        if inp.ops:
            replay_pool_ops(inp.ops, self.pools.kv, self.pools.mamba)
        return self.execute_local(inp)

    def clear_logit_plan(self) -> None:
        """Forget the prompt-logits plan of the last prepared prefill (a step that is not it starts)."""
        self._plan = None

    def execute_local(self, inp: StepInputs, before_forward=None) -> torch.Tensor | None:
        """`execute` on this rank alone (no tensor-parallel message): the collected expert cache, the
        prefill or decode forward (graph-replayed where one applies), read-through offload's
        begin_step / end_step around a decode; `before_forward(batch, replays)` runs once the inputs are
        loaded (overlapped decode feeds its ids there; `replays`: the step replays a captured graph) and may
        return a callable to run right after the step is queued (`DecodeGraphs.run`'s `after_launch`: a
        gated step's rows, `RowsBuffer.stage`)."""
        experts = self.pools.experts
        rt = experts.read_through if experts is not None else None
        if experts is not None and (inp.kind != "decode" or rt is None):
            # NOTE: the last offloaded decode step's record, before anything reads the cache; a
            # read-through decode step needs none of it (the device mapped what that step landed):
            # its end_step takes it in while this step runs, off the critical path
            experts.collect()
        if inp.kind != "decode":
            rows = self._prefill_graph_rows(inp)
            if rows is None:
                return self.model.forward(self.load(inp), self.pools)
            batch = self.load(padded_inputs(inp, rows))
            return self.prefill_graphs.run(rows, self._graph_key(experts, None, kv=False), batch,
                                           lambda: self.model.forward(batch, self.pools), self.pools.kv.layer)
        # decode: a graph replay where one applies, else eager; offloaded experts in read-through
        # mode are bracketed by the cache's begin_step / end_step
        if rt is not None:
            rt.begin_step(inp.real, self.model.top_k)
        try:
            batch = self.load(inp)
            eager = inp.graph_rows is None or self.graphs is None or self.graphs.disabled
            key = None if eager else self._graph_key(experts, rt)
            after_launch = None
            if before_forward is not None:  # (overlapped decode: the ids fed on the device)
                after_launch = before_forward(batch, not eager and self.graphs.will_replay(inp.graph_rows, key))
            if batch.ngram_gate is not None and after_launch is None and self.ngram_rows.owed:
                raise RuntimeError("a decode step's n-gram rows were never staged: its gate would wait forever")
            if eager:
                if after_launch is not None:
                    after_launch()
                logits = self.model.forward(batch, self.pools)
            else:
                logits = self.graphs.run(inp.graph_rows, key, lambda: self.model.forward(batch, self.pools),
                                         after_launch)
            if batch.ngram_gate is not None:
                self.ngram_rows.mark()
            return None if logits is None else logits[: inp.real]
        except BaseException:
            if self.ngram_rows is not None and self.ngram_rows.gated:
                self.ngram_rows.settle()  # (a failed step must not leave the flag set for the next one's gate)
            raise
        finally:
            if rt is not None:
                rt.end_step()

    def graph_rows_for(self, b: int) -> int | None:
        """The rows of the CUDA graph bucket that a decode step of b sequences replays, or None
        (eager: no graphs, b over the largest bucket, or a MoE that cannot be captured)."""
        if self.graphs is None or self.graphs.disabled:
            return None
        experts = self.pools.experts
        capturable = experts is None or (runs_triton(experts.slots, self.device)
                                         and (experts.all_resident or experts.read_through is not None))
        # NOTE: offloaded experts without read-through are loaded by host-side bookkeeping, and the
        # reference MoE (dense slots) groups pairs on the host: neither can be captured
        return self.graphs.bucket(b) if capturable else None

    def _prefill_graph_rows(self, inp: StepInputs) -> int | None:
        """The token bucket whose prefill graphs this prefill replays (`PrefillGraphs.rows_for`), or
        None (eager); also eager on several GPUs and unless every expert is resident on Triton."""
        g, experts = self.prefill_graphs, self.pools.experts
        if g is None or self.tp is not None or (experts is not None and not (
                runs_triton(experts.slots, self.device) and experts.all_resident)):
            return None
        return g.rows_for(inp)

    def _graph_key(self, experts, rt, kv: bool = True) -> tuple:
        # NOTE: the decode step reads the pools through Triton kernels only (pointers and strides, no
        # bound baked in), so a graph stays valid while the addresses stay: a VMM rebuild keeps them.
        # A prefill graph leaves the KV pool and the page table to its eager attention cores (kv=False).
        pools = (self.pools.kv.tensors if kv else []) + self.pools.mamba.tensors
        if experts is not None:
            pools = pools + experts.tensors + [experts.slot_table]
            if rt is not None:
                pools = pools + list(rt.book) + [t for t in experts.host if t is not None]
        if not kv:
            return (*(t.data_ptr() for t in pools), *(buf.device_buffer.data_ptr() for buf in self.buffers.values()))
        forced = self.buffers.get("forced_experts")  # (synthetic routing traces only)
        return (*(t.data_ptr() for t in pools), self.page_table.table.data_ptr(),
                *(buf.device_buffer.data_ptr() for buf in self.decode_buffers.values()),
                forced.device_buffer.data_ptr() if forced is not None else 0,
                self.ngram_rows.device_buffer.data_ptr() if self.ngram_rows is not None else 0)

    def count_resident_hits(self, tokens: int) -> None:
        """Resident experts: every (token, expert) pair is a hit (the MoE layer does not count
        them, since a replayed graph runs no Python)."""
        experts = self.pools.experts
        if experts is not None and experts.all_resident:
            experts.stats.hits += tokens * self.model.moe_pairs_per_token

    def _to_host(self, ids: torch.Tensor | None, extras: list[torch.Tensor] = ()) -> tuple[list[int], list[list[float]]]:
        """The step's sampled ids and extra tensors on the host (`ResultCopy.to_host`)."""
        return self.results.to_host(ids, extras)

    def _wait(self) -> None:
        """Wait for this step's device work (`ResultCopy.wait`)."""
        self.results.wait()


def _tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start+n] without building the whole list."""
    p = len(seq.prompt_ids)
    out = seq.prompt_ids[start : start + n] if start < p else []
    if start + n > p:
        out += seq.output_ids[max(0, start - p) : start + n - p]
    return out
