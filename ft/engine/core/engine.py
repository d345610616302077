"""The engine: the composition root. One step reads like a spec:

    ladder move (if any) -> work = scheduler.schedule() -> tokens = runner.run(work) -> postprocess

The engine owns every tensor through its parts: the cache manager (budget, pools, rebuilds,
history), the scheduler and prefix cache, the model runner, and the ladder policy. Callers (the
LLM API, the server's engine thread) only add requests, step, abort, and resize.
"""

from __future__ import annotations

import logging
import time

import torch

from ft.engine.base.engine_config import MAMBA_ON_DEMAND_MIN, EngineConfig
from ft.engine.core.choices import ChoiceGroups
from ft.engine.sched.ladder import Ladder, LadderOptions
from ft.engine.sched.ladder_driver import LadderDriver
from ft.engine.sched.loan import ReserveLoan
from ft.engine.sched.mamba_demand import MambaOnDemand
from ft.engine.sched.prefix_cache import PrefixCache
from ft.engine.core.request_builder import RequestBuilder
from ft.engine.ranks.rank_state import KV_ALGO_DTYPES, KV_DTYPES, RankState
from ft.engine.base.sampling_params import SamplingParams
from ft.engine.sched.scheduler import Scheduler, ScheduledWork
from ft.engine.core.stats import EngineStats, engine_stats
from ft.engine.core.slow_steps import SlowSteps, engine_captures
from ft.engine.core.step_times import StepShape, StepTimes
from ft.engine.worker.overlap import OverlappedDecode
from ft.engine.base.sequence import Sequence
from ft.engine.text.tokenizer import Tokenizer
from ft.engine.ranks.tp_worker import close_ranks, dead_rank, join_group, join_ranks, start_workers, stop_workers
from ft.errors import ConfigError, RanksOutOfStep
from ft.memory.cache_pools import CachePools
from ft.memory.device_memory import DeviceMemoryProbe
from ft.memory.host_memory import HOST_MARGIN, HostPlan
from ft.units import format_bytes

log = logging.getLogger("ft.engine")


PROMPT_LOGIT_BYTES = 12
"""Bytes per vocabulary entry of one prompt position's logits while prompt logprobs are computed (the
float32 logits, their log-softmax and the gathers' temporaries)."""
PROMPT_LOGITS_MIN_TOKENS = 16


class Engine(RankState):
    def __init__(self, config: EngineConfig) -> None:
        self._workers = start_workers(config)  # tensor parallelism: ranks 1.. in processes of their own
        self.tp_failure: str | None = None  # a worker rank that exited: the engine cannot step
        try:
            tp = join_group(config, 0, self._workers)
            super().__init__(config, tp)
            config = self.config  # with the defaults decided at startup (the prefill chunk)
            if tp is not None:
                self._join_workers()
        except BaseException:
            stop_workers(self._workers)
            raise
        cfg = self.model_config
        self.tokenizer = Tokenizer.from_dir(  # --tokenizer / --chat-template replace the checkpoint's
            config.tokenizer or self.source.tokenizer_dir(), chat_template=config.chat_template,
            model_dir=self.model_path if config.tokenizer and self.model_path.is_dir() else None)
        pools = self.cache.pools
        self.prefix_cache = PrefixCache(pools.kv, pools.mamba, config.enable_prefix_cache,
                                        host_entries=self._prefix_host_entries(config))
        # prompt logprobs return a float32 row of logits (plus its log-softmax) per prompt position: as many
        # positions per step as the activation reserve holds, which it holds at the end of the forward
        # (a vocabulary split over tensor-parallel ranks gathers the rows: 8 bytes more per entry on rank 0)
        per_entry = PROMPT_LOGIT_BYTES + (8 if self.model.vocab_lo is not None else 0)
        # (with the prefill reserve's loan out, the part a short step keeps: `ReserveLoan`)
        prompt_logit_tokens = max(PROMPT_LOGITS_MIN_TOKENS,
                                  (self.reserve - self.loan_bytes) // (cfg.vocab_size * per_entry))
        self.scheduler = Scheduler(pools.kv, pools.mamba, self.prefix_cache, config.max_running_requests,
                                   config.max_prefill_length, min(config.max_prefill_length, prompt_logit_tokens),
                                   mix_decode=config.mix_prefill_decode, solo_prefill_tokens=self.prefill_graph_tokens,
                                   mixed_prefill_tokens=config.max_mixed_prefill_length)
        self.cache.attach(self.scheduler, self.prefix_cache)
        rungs = self.rungs
        self.ladder = Ladder(rungs, LadderOptions(
            config.ladder_step_size, config.ladder_min_reuse, config.ladder_dwell_s, config.ladder_grow_hold_s,
        )) if rungs else None
        self.ladder_driver = LadderDriver(self.ladder, self.cache, self.scheduler, self.prefix_cache) \
            if self.ladder else None
        self.requests_in = RequestBuilder(cfg, self.tokenizer)
        self.choices = ChoiceGroups(self.scheduler)  # n > 1: one shared prompt prefill
        self._requests: dict[str, Sequence] = {}
        self.current_work: ScheduledWork | None = None  # the work of a step in progress (None between steps)
        self.overlap = OverlappedDecode(self)  # `--overlap-decode`: the decode step in flight, if any
        # --lend-prefill-reserve: the expert slots borrow the prefill reserve while prompts are short
        self.loan = ReserveLoan(self.cache, self.scheduler, self.loan_keep_tokens, self.loan_beside,
                                hold_s=config.loan_hold_s) if self.loan_bytes else None
        if self.loan is not None:
            self.loan.lend("startup: no prompt needs the prefill reserve yet")
        # --mamba-on-demand: device mamba slots for the running requests only, grown when one waits for a slot
        self.mamba_demand = MambaOnDemand(self.cache, self.scheduler, MAMBA_ON_DEMAND_MIN,
                                          lambda: len(self.waiting_requests())) \
            if config.mamba_on_demand else None
        if self.mamba_demand is not None and config.enable_prefix_cache \
                and not config.prefix_host_entries(self.device.type):
            raise ConfigError("--mamba-on-demand needs the prefix cache's states in host memory "
                              "(--prefix-states-on-host) or no prefix cache")
        budget = self.cache.budget
        # the card's use by the driver's count beside the planned budget (None on the CPU)
        self.device_memory = DeviceMemoryProbe(self.device, budget.card_bytes, budget.headroom_bytes)
        self.started_at = time.time()
        self.started_monotonic = time.monotonic()  # the admin API's uptime never goes backwards
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.step_times = StepTimes()  # steps and their wall time by kind (`ft.engine.core.step_times`)
        # steps far slower than their kind's usual, logged with what they paid for (`ft.engine.core.slow_steps`)
        self.slow_steps = SlowSteps(self.device)
        self.slow_steps.pause()  # (until a server says it is ready: `ft serve` resumes it; a library user may)
        self._step_shape: StepShape | None = None  # the rows of the step `_step` ran (None: it ran none)

    def _join_workers(self) -> None:
        """The startup gather (`tp_worker.join_ranks`): every worker rank built, its caches sized as
        rank 0's; the rebuilds' peers."""
        self.cache.peers = join_ranks(self.tp, self.cache, self._workers)

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks (nothing to do on one GPU; `tp_worker.close_ranks`).
        Idempotent."""
        tp, workers = self.tp, self._workers
        self.tp, self._workers = None, None
        close_ranks(tp, workers, self.runner.graphs)

    def _check_workers(self) -> None:
        """Before a step: every worker rank's process still runs. One that exited (killed, out of
        memory, a crash) cannot be replaced live: the engine stops stepping and says which
        (`tp_failure`, reported by /health), instead of waiting in a collective for a dead peer."""
        if self.tp_failure is None:
            self.tp_failure = dead_rank(self._workers)
            if self.tp_failure is not None:
                log.error("%s", self.tp_failure)
        if self.tp_failure is not None:
            raise RuntimeError(self.tp_failure)

    @property
    def pools(self) -> CachePools:
        return self.cache.pools

    @property
    def last_logits(self) -> torch.Tensor | None:
        """[B, V] logits of the last step (tests and debugging)."""
        return self.runner.last_logits

    # ----------------------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Queue a request after checking it can ever be served (RequestError otherwise)."""
        seq = self._new_sequence(prompt_ids, params, request_id)
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def waiting_requests(self) -> list[Sequence]:
        """Requests not yet running: the scheduler's queue, then the n-choice siblings that wait for
        their parent's prompt prefill (outside the scheduler, holding nothing: `add_request_group`)."""
        return list(self.scheduler.waiting) + self.choices.waiting(self._requests.values())

    def add_request_group(self, prompt_ids: list[int], params_list: list[SamplingParams],
                          request_ids: list[str | None] | None = None) -> list[Sequence]:
        """n requests of one prompt (an API call with n > 1: choice i gets params_list[i]) that share
        one prompt prefill (`ft.engine.core.choices`: the siblings fork from the first, the parent, at
        its first token). Every one is checked first (RequestError: none is queued)."""
        request_ids = list(request_ids) if request_ids is not None else [None] * len(params_list)
        if len(request_ids) != len(params_list) or not params_list:
            raise ValueError("add_request_group: one request id per SamplingParams, at least one")
        seqs = [self._new_sequence(prompt_ids, p, rid) for p, rid in zip(params_list, request_ids)]
        for seq in seqs:
            self._requests[seq.request_id] = seq
        self.choices.queue(seqs)
        return seqs

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> Sequence:
        return self.requests_in.build(prompt_ids, params, request_id, self.servable_context, self.context_reason)

    @property
    def servable_context(self) -> int:
        """Tokens a request admitted now can reach: the context limit, capped by the KV cache's
        capacity, or with the ladder on auto by its highest rung that keeps the expert floor (the
        ladder grows to it for the request). With the ladder's auto off nothing grows by itself: the
        KV cache caps it, as without a ladder (a request is refused up front or ends with `length`,
        never fails after it ran)."""
        kv = self.pools.kv.num_tokens
        if self.ladder is not None and self.ladder.auto:
            kv = max([kv] + [r for r in self.ladder.rungs if self.cache.moe_beside(r) is not None])
        return min(self.context_limit, kv)

    def context_reason(self, limit: int) -> str:
        """What caps `servable_context` at `limit`, in words."""
        if limit >= self.context_limit:
            return f"the context limit is {self.context_limit} tokens"
        if self.ladder is not None and self.ladder.auto:
            return (f"the highest KV ladder rung that keeps the expert floor holds {limit} tokens "
                    f"(context limit {self.context_limit})")
        if self.ladder is not None:
            return (f"the KV cache holds {limit} tokens and the KV ladder's auto is off (turn it on with "
                    "`ft ctl ladder --auto on`, or move a rung up with `ft ctl ladder --up`)")
        return (f"the KV cache holds {limit} tokens (the context limit is {self.context_limit}: grow the "
                "cache with `ft ctl cache --kv`, or start with a larger --num-tokens)")

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its pages and its mamba slot are freed at once."""
        seq = self._requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.choices.detach(seq)  # a sibling still waiting for its parent's prefill: it holds nothing
        self.scheduler.finish(seq, "abort", cache=False)
        seq.grammar = None
        self.choices.release(seq)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.overlap.inflight is not None

    # ----------------------------------------------------------------------------- stepping
    def step(self) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that got a new token (finished ones too)
        and those that ended with an error before running.

        Overlapped decode (`EngineConfig.overlap_decode`, `ft.engine.worker.overlap`): a plain decode batch
        is queued on the device and the step returns the tokens of the one queued before it, after
        queuing the next: the host reads tokens and prepares the next step while the device
        computes. Anything else (a request waiting, a prefill) first takes the tokens in flight,
        then steps as usual."""
        if self._workers:
            self._check_workers()
        t0 = time.perf_counter()
        mark = self.slow_steps.mark(engine_captures(self), self.cache.history)
        if self.overlap.inflight is not None:
            out = self.overlap.step()
            self._account("decode", time.perf_counter() - t0, StepShape(decode_rows=len(out)), mark)
            return out
        self._step_shape = None
        out = self._step()
        if self._step_shape is not None:
            self._account(self._step_shape.kind, time.perf_counter() - t0, self._step_shape, mark)
        return out

    def _account(self, kind: str, seconds: float, shape: StepShape, mark) -> None:
        """A step's time by kind, and its warning line if it was slow (`ft.engine.core.slow_steps`)."""
        self.step_times.add(kind, seconds)
        line = self.slow_steps.end(kind, seconds, shape, mark, engine_captures(self), self.cache.history)
        if line is not None:
            log.warning("%s", line)

    def _step(self) -> list[Sequence]:
        rejected = []
        if self.mamba_demand is not None:
            self.mamba_demand.before_step()
        if self.loan is not None:
            self.loan.before_step()
        if self.ladder is not None:
            rejected = self.ladder_driver.before_admission(self._fail)
            self.ladder_driver.before_decode()
        if self.mamba_demand is not None:
            self.mamba_demand.before_admission()
        work = self.scheduler.schedule()
        self.scheduler.hold_head = False
        if work is None:
            return rejected + self._reject_unservable()
        self.current_work = work  # NOTE: what a step that raises was running (the server fails only those)
        self._step_shape = StepShape.of(work)  # (before the step moves the sequences on)
        if self.loan is not None:
            self.loan.before_run(work)
        self.runner.last_logprobs, self.runner.last_prompt_logprobs = [], []  # (a stand-in runner may leave them)
        if not work.is_prefill and self.overlap.ok(work.seqs):
            return rejected + self.overlap.start(work.seqs)
        try:
            tokens = self.runner.run(work)
        except RanksOutOfStep as e:  # no later step can run: said by /health, as a dead worker is
            self.tp_failure = str(e)
            log.error("%s", self.tp_failure)
            raise
        self.current_work = None
        return rejected + self._postprocess(work, tokens)

    def _prefix_host_entries(self, config: EngineConfig) -> int:
        """The prefix cache's entries that keep their linear-attention state in pinned host memory
        (`EngineConfig.prefix_host_entries`), in the host plan as "prefix states". Where the plan checked before
        loading leaves the host too little for them all (its 2 GiB margin kept), as many as fit, at least one,
        and a log line that says so."""
        n = config.prefix_host_entries(self.device.type)
        state = self.cache.layout.unit_costs().mamba_slot
        if not n or not state:
            return n
        plan = self.host_plan
        if plan.available is not None and config.host_memory_check:
            fit = max(1, (plan.available[0] - HOST_MARGIN - plan.total) // state)
            if fit < n:
                log.warning("prefix cache: %d of %d entries keep their linear-attention state in host memory (%s "
                            "each): what the host had before loading (%s) leaves room for no more beside %s",
                            fit, n, format_bytes(state), format_bytes(plan.available[0]), plan.parts_text())
                n = fit
        self.host_plan = HostPlan({**plan.parts, "prefix states": n * state}, plan.available)
        return n

    # ------------------------------------------------------------------- overlapped decode
    def drain(self) -> list[Sequence]:
        """Take the tokens of the decode step in flight (overlapped decode), so that the pools and
        every sequence are as after a plain step: call it before anything outside `step` works on
        them (a rebuild, a ladder move; the server's commands do). Returns the sequences that got
        a token, as `step` does ([] when nothing is in flight)."""
        return self.overlap.drain()

    @property
    def overlapped_steps(self) -> int:
        """Decode steps queued behind one in flight (tests, benchmarks)."""
        return self.overlap.steps

    def _reject_unservable(self) -> list[Sequence]:
        """Nothing runs and the first waiting request still cannot start: the pools are too small
        for it (they were shrunk after it was queued). Finish it with an error, never spin."""
        sched = self.scheduler
        if sched.running or not sched.waiting or sched.admission_paused:
            return []
        seq = sched.waiting[0]
        kv = self.pools.kv
        need = kv.pages_for(seq.num_tokens + 1) * kv.page_size
        if need <= kv.num_tokens:  # the pages exist but others hold them (the prefix cache, a leak)
            why = f"{kv.num_free_pages} of {kv.num_pages} KV pages are free, {need // kv.page_size} needed"
        else:
            why = f"the KV cache holds {kv.num_tokens} tokens"
            resized = [h for h in self.cache.history if h["trigger"] != "startup" and h["status"] == "ok"
                       and h["time"] >= seq.queued_at]
            if resized:
                why += " (it was resized after the request was queued)"
        return [self._fail(seq, f"the request needs {need} tokens of KV cache; {why}")]

    def _fail(self, seq: Sequence, error: str) -> Sequence:
        seq.error = error
        self.scheduler.finish(seq, "error", cache=False)
        self._requests.pop(seq.request_id, None)
        seq.grammar = None
        self.choices.release(seq)
        return seq

    def _postprocess(self, work: ScheduledWork, tokens: list[int | None]) -> list[Sequence]:
        out = []
        self.counters["steps"] += 1
        for seq, first, entries in self.runner.last_prompt_logprobs:
            seq.prompt_logprobs[first : first + len(entries)] = entries
        logprobs = self.runner.last_logprobs if len(self.runner.last_logprobs) == len(tokens) else [None] * len(tokens)
        for row, (seq, n, token, lp) in enumerate(zip(work.seqs, work.num_tokens, tokens, logprobs)):
            if seq.num_computed < len(seq.prompt_ids):
                self.counters["prompt_tokens"] += min(n, len(seq.prompt_ids) - seq.num_computed)
            seq.num_computed += n
            if token is None:
                continue  # a chunk of a longer prompt: no token yet
            # NOTE: the fork point of n > 1 siblings: before the parent can finish (its pages and
            # slot would go) and before any later forward changes its state and its last page
            forks = self.choices.fork(seq, row, self.runner) if seq.fork_waiting else []
            self.take_token(seq, token, lp, out)
            for sib, sib_token, sib_lp in forks:
                self.take_token(sib, sib_token, sib_lp, out)
        return out

    def take_token(self, seq: Sequence, token: int, lp, out: list[Sequence]) -> None:
        """A sampled token joins `seq` (ending it when it should); `seq` goes into `out`."""
        seq.output_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(lp)
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        self.counters["generation_tokens"] += 1
        if seq.grammar is not None and not seq.grammar.accept(token):
            seq.text.step(token)  # NOTE: the mask forbids this; a matcher failure ends the request
            out.append(self._fail(seq, f"structured output: {seq.grammar.error or 'token not allowed'}"))
            return
        reason = self._finish_reason(seq, token)
        if reason:
            self.scheduler.finish(seq, reason)
            self._requests.pop(seq.request_id, None)
            seq.grammar = None  # its matcher is freed with it
        out.append(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Feed `token` to the sequence's text; the reason it ends now, if it does."""
        seq.text.step(token)  # what it releases is in seq.text.delta
        if token in seq.stop_token_ids:
            seq.text.finish()
            return "stop"
        if seq.text.stop_found:
            seq.stop_text = seq.text.cut()
            return "stop"
        if seq.grammar is not None and seq.grammar.done:  # the grammar is complete: nothing else may follow
            seq.text.finish()
            return "stop"
        if len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.context_limit:
            seq.text.finish()
            return "length"
        return None

    def pause_admission(self, paused: bool) -> None:
        """Stop (or resume) admitting waiting requests; running ones go on (a resize waiting for room)."""
        self.scheduler.admission_paused = paused

    def stats(self) -> EngineStats:
        """The engine's figures now, as one immutable value (`ft.engine.core.stats`)."""
        return engine_stats(self)

    def text_of(self, seq: Sequence) -> str:
        """The generated text (cut before a stop string when one ended the request)."""
        if seq.stop_text is not None:
            return seq.stop_text
        if seq.is_finished:
            seq.text.finish()  # an abort or error: release the held tail
        return seq.text.text

    def run_until_done(self, seqs: list[Sequence], timeout_s: float | None = None) -> None:
        t0 = time.monotonic()
        while any(not s.is_finished for s in seqs):
            self.step()
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError("generation did not finish in time")

    # ----------------------------------------------------------------------------- ladder
    def move_ladder(self, rung: int | str, reason: str | None = None) -> dict:
        """A manual rung move: an index, "up" or "down" (RebuildRefused / RebuildFailed like any
        rebuild; ConfigError when the ladder is off)."""
        if self.ladder is None:
            raise ConfigError("the KV ladder is off: start ft serve with --enable-kv-ladder")
        return self.ladder_driver.move(rung, reason)

    # ----------------------------------------------------------------------------- reports
    def describe(self) -> dict:
        """What was measured and chosen at startup (printed by the CLI, served by the admin API)."""
        return {
            "model": str(self.model_path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "resident_weight_bytes": self.model.resident_bytes,
            "host_table_bytes": self.model.host_bytes,  # (host memory, outside the budget)
            "host_tables": dict(self.model.host_tables),  # what: bytes (the n-gram table, the embedding)
            # tables mapped from the checkpoint's files, read through the page cache ({what: bytes on disk})
            "disk_tables": dict(getattr(self.model, "disk_tables", {})),
            # what the loader planned to keep in host memory ({what: bytes}, the routed experts too) and
            # what the host had then (bytes and where that figure comes from; None where unknown)
            "host_plan": {"parts": dict(self.host_plan.parts),
                          "available_bytes": self.host_plan.available[0] if self.host_plan.available else None,
                          "available_from": self.host_plan.available[1] if self.host_plan.available else None},
            "context_limit": self.context_limit,
            "tensor_parallel_size": self.tp.world if self.tp is not None else 1,
            **self.cache.describe(),
        }


__all__ = ["Engine", "KV_ALGO_DTYPES", "KV_DTYPES"]
