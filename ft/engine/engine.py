"""The engine: loads a checkpoint, sizes the pools from the measured budget, runs steps.

One step reads like a spec: `work = scheduler.schedule()` -> `logits = model.forward(batch)` ->
`self._postprocess(work, logits)`. The engine owns every tensor; callers (the LLM API, the
server's engine thread) only add requests, step, and abort.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ft.engine.checkpoint import CheckpointReader, load_weights
from ft.engine.config import ModelConfig
from ft.engine.engine_config import EngineConfig
from ft.engine.errors import RequestError
from ft.engine.forward_batch import ForwardBatch, SeqSlice
from ft.engine.layers.linear import NVFP4Weight
from ft.engine.memory.budget import Geometry, MemoryBudget, UnitCosts, measure_budget, startup_geometry
from ft.engine.memory.expert_cache import ExpertCache
from ft.engine.memory.kv_pool import KVPool
from ft.engine.memory.mamba_pool import MambaPool
from ft.engine.memory.storage import PoolStorage
from ft.engine.memory.planner import Limits, Plan, plan, reachable_ranges, sizes
from ft.engine.models.qwen3_next import CachePools, Qwen3NextModel, tensor_specs
from ft.engine.ladder import Ladder, LadderOptions, make_rungs
from ft.engine.prefix_cache import PrefixCache
from ft.engine.rebuild import Rebuilder, RebuildFailed, geometry_of
from ft.engine.sampler import sample
from ft.engine.sampling_params import SamplingParams
from ft.engine.scheduler import Scheduler, ScheduledWork
from ft.engine.sequence import Sequence
from ft.engine.tokenizer import Tokenizer
from ft.kernels.moe import moe_workspace_bytes
from ft.kernels.nvfp4 import uses_triton

log = logging.getLogger("ft.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | None) -> Path:
    """A checkpoint directory; for "synthetic:PATH/config.json" the config file itself."""
    from ft.engine.synthetic import config_path, is_synthetic

    if is_synthetic(model):
        return config_path(model)
    if model in (None, "", "demo"):
        from ft.engine.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return Path(model).expanduser()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        t_start = time.time()
        self.config = config
        self.device = _device(config.device)
        self.dtype = DTYPES[config.dtype] if config.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_file(self.model_path)
        self.tokenizer = Tokenizer.from_dir(self.model_path if self.model_path.is_dir() else _stand_in_tokenizer())
        self.model = self._load_model()
        cfg = self.model_config
        self.context_limit = config.max_seq_len_override or cfg.max_position_embeddings
        self.expert_floor = min(cfg.num_experts_per_tok, self.total_experts) if self.total_experts else 0
        self.unit_costs = self._measure_unit_costs()
        self.budget = measure_budget(
            self.device, self.model.resident_bytes, config.memory_ratio, config.gpu_memory_limit,
            self._activation_reserve(), config.cache_budget,
        )
        rungs = make_rungs(config.ladder_step_size, self.context_limit, config.page_size) if config.enable_kv_ladder else None
        self.geometry = startup_geometry(
            self.budget, self.unit_costs, total_experts=self.total_experts, expert_floor=self.expert_floor,
            context_limit=self.context_limit, mamba_slots=config.mamba_slots,
            num_tokens=rungs[0] if rungs else config.num_tokens,
            moe_backend=config.moe_backend, moe_cache_size=config.moe_cache_size,
        )
        self.pools = self._build_pools(self.geometry)
        self.prefix_cache = PrefixCache(self.pools.kv, self.pools.mamba, config.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.pools.kv, self.pools.mamba, self.prefix_cache, config.max_running_requests, config.max_prefill_length
        )
        self._requests: dict[str, Sequence] = {}
        self.rebuilder = Rebuilder(self)
        self.ladder = Ladder(self, LadderOptions(
            config.ladder_step_size, config.ladder_min_reuse, config.ladder_dwell_s, config.ladder_grow_hold_s,
        )) if config.enable_kv_ladder else None
        self.started_at = time.time()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        # every rebuild, startup included (see ft.schemas.HistoryEntry for the fields)
        self.history: list[dict] = [{
            "id": 0, "time": self.started_at, "trigger": "startup", "reason": None, "from": {},
            "to": sizes(self.geometry), "peak_bytes": self.geometry.nbytes(self.unit_costs),
            "status": "ok", "error": None, "phases": {"total_s": round(time.time() - t_start, 3)},
        }]

    # ----------------------------------------------------------------------------- loading
    def _load_model(self) -> Qwen3NextModel:
        from ft.engine.synthetic import is_synthetic, synthetic_weights

        specs, expert_names = tensor_specs(self.model_config)
        if is_synthetic(self.config.model):
            weights = synthetic_weights(specs, expert_names, self.dtype, self.device, self.config.seed)
        else:
            reader = CheckpointReader(self.model_path)
            weights = load_weights(
                reader, specs, expert_names, self.dtype, self.device, torch.device("cpu"), self.config.progress
            )
        if not uses_triton(self.device):
            # NOTE: the CPU path computes resident projections dense (the exact dequantized values);
            # routed experts stay NVFP4 in the host store and the slots. (Interpreter tests keep
            # them NVFP4 to run the Triton kernels on the CPU.)
            weights.tensors = {
                k: (v.dequantize(self.dtype) if isinstance(v, NVFP4Weight) else v) for k, v in weights.tensors.items()
            }
        self._host_experts = weights.experts
        return Qwen3NextModel(self.model_config, weights, self.dtype, self.device)

    @property
    def total_experts(self) -> int:
        h = self._host_experts
        return 0 if h is None else h.w13.shape[0] * h.w13.shape[1]

    def _measure_unit_costs(self) -> UnitCosts:
        kv = self._kv_pool(1)
        mamba = self._mamba_pool(1)
        expert = ExpertCache(self._host_experts, 1, self.device).bytes_per_slot if self._host_experts else 0
        return UnitCosts(kv.bytes_per_page, kv.page_size, mamba.bytes_per_slot, expert)

    def _activation_reserve(self) -> int:
        """Bytes of activations alive at the peak of the largest forward pass (a full prefill
        chunk): the residual stream and a normalised copy, plus the widest projection output
        twice (its input split and its product), plus the Triton MoE's fp32 workspace on CUDA. Estimated
        from the config; the CUDA path will replace this with a profiled figure."""
        c = self.model_config
        widest = max(
            2 * c.linear_key_dim + 2 * c.linear_value_dim,  # in_proj_qkvz
            2 * c.num_attention_heads * c.head_dim,  # q with its gate
            2 * c.num_experts_per_tok * c.moe_intermediate_size,  # routed gate/up of every pair
            2 * max(c.shared_expert_intermediate_size, c.intermediate_size),
            c.num_experts,
        )
        tokens = min(self.config.max_prefill_length, self.context_limit)
        per_token = (3 * c.hidden_size + 2 * widest) * torch.finfo(self.dtype).bits // 8
        moe = 0
        if uses_triton(self.device):  # the Triton MoE's workspace (the CPU reference allocates per group)
            moe = moe_workspace_bytes(tokens, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size)
        return tokens * per_token + moe + self.config.max_running_requests * c.vocab_size * 4

    def _kv_pool(self, pages: int, storage: PoolStorage | None = None) -> KVPool:
        c = self.model_config
        return KVPool(
            pages, self.config.page_size, len(c.full_attention_layers), c.num_key_value_heads, c.head_dim,
            self.dtype, self.device, storage,
        )

    def _mamba_pool(self, slots: int, storage: PoolStorage | None = None) -> MambaPool:
        c = self.model_config
        return MambaPool(
            slots, len(c.linear_attention_layers), c.linear_conv_dim, c.linear_conv_kernel_dim,
            c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, self.dtype, self.device,
            storage,
        )

    def _build_pools(self, geo: Geometry) -> CachePools:
        # one reserved range per pool tensor, as large as the whole budget (CUDA VMM when present)
        self.storage = PoolStorage(self.device, self.budget.budget_bytes)
        experts = None
        if self._host_experts is not None:
            experts = ExpertCache(self._host_experts, geo.moe_slots, self.device, storage=self.storage)
            if self.config.moe_backend == "resident":
                experts.preload_all()
        kv = self._kv_pool(geo.kv_tokens // self.config.page_size, self.storage)
        return CachePools(kv, self._mamba_pool(geo.mamba_slots, self.storage), experts)

    # ----------------------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Queue a request after checking it can ever be served (RequestError otherwise)."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if n >= self.context_limit:
            raise RequestError(
                f"the prompt is {n} tokens; the context limit is {self.context_limit} tokens "
                "(the prompt plus at least one new token must fit)"
            )
        if n + 1 > self.pools.kv.num_tokens:
            raise RequestError(
                f"the prompt is {n} tokens; the KV cache holds {self.pools.kv.num_tokens} tokens "
                "(raise --num-tokens)"
            )
        room = self.context_limit - n
        max_new = room if params.max_new_tokens is None else min(params.max_new_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        seq = Sequence(list(map(int, prompt_ids)), params, max_new, frozenset(stop_ids))
        if request_id:
            seq.request_id = request_id
        if not params.greedy:
            seed = params.seed if params.seed is not None else torch.randint(0, 2**62, (1,)).item()
            seq.generator = torch.Generator(device="cpu").manual_seed(int(seed))
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its pages and its mamba slot are freed at once."""
        seq = self._requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort", cache=False)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ----------------------------------------------------------------------------- stepping
    def step(self) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that got a new token (finished ones too)."""
        if self.ladder is not None:
            self.ladder.before_admission()
        work = self.scheduler.schedule()
        if work is None:
            return self._reject_unservable()
        batch = self._make_batch(work)
        logits = self.model.forward(batch, self.pools)
        self.last_logits = logits  # [B, V] of this step (tests and debugging read it)
        return self._postprocess(work, logits)

    def _reject_unservable(self) -> list[Sequence]:
        """Nothing runs and the first waiting request still cannot start: the pools are too small
        for it (they were shrunk after it was queued). Finish it with an error, never spin."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return []
        seq = sched.waiting[0]
        seq.error = (
            f"the request needs {seq.num_tokens + 1} tokens of KV cache; the cache now holds "
            f"{self.pools.kv.num_tokens} (it was resized after the request was queued)"
        )
        sched.finish(seq, "error", cache=False)
        self._requests.pop(seq.request_id, None)
        return [seq]

    def _make_batch(self, work: ScheduledWork) -> ForwardBatch:
        ids, pos, slices = [], [], []
        for seq, n in zip(work.seqs, work.num_tokens):
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            pages = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
            slices.append(SeqSlice(start, n, pages, seq.mamba_slot))
        dev = self.device
        return ForwardBatch(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), slices)

    def _postprocess(self, work: ScheduledWork, logits: torch.Tensor) -> list[Sequence]:
        out = []
        logits = logits.cpu()
        self.counters["steps"] += 1
        for seq, n, row in zip(work.seqs, work.num_tokens, logits):
            if seq.num_computed < len(seq.prompt_ids):
                self.counters["prompt_tokens"] += min(n, len(seq.prompt_ids) - seq.num_computed)
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue  # a chunk of a longer prompt: no token yet
            token = sample(row, seq.params, seq.generator)
            seq.output_ids.append(token)
            self.counters["generation_tokens"] += 1
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                self._requests.pop(seq.request_id, None)
            out.append(seq)
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_token_ids:
            return "stop"
        if seq.params.stop:
            text = self.tokenizer.decode(seq.output_ids)
            cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.stop_text = text[:cut]
                return "stop"
        if len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.context_limit:
            return "length"
        return None

    def text_of(self, seq: Sequence) -> str:
        """The generated text (cut before a stop string when one ended the request)."""
        if seq.stop_text is not None:
            return seq.stop_text
        return self.tokenizer.decode(seq.output_ids)

    def run_until_done(self, seqs: list[Sequence], timeout_s: float | None = None) -> None:
        t0 = time.monotonic()
        while any(not s.is_finished for s in seqs):
            self.step()
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError("generation did not finish in time")

    # ----------------------------------------------------------------------------- geometry
    def limits(self, held: bool = True) -> Limits:
        """Floors and ceilings of each pool now: the expert floor, the KV pages and mamba slots
        that running requests hold (`held=False`: as if none ran); every expert, and (KV, mamba)
        only the budget above."""
        running = self.scheduler.running if held else []
        held_pages = len({p for s in running for p in s.pages})
        # a queued request must still fit once it is its turn
        waiting = self.scheduler.waiting if held else []
        waiting_pages = max((self.pools.kv.pages_for(s.num_tokens + 1) for s in waiting), default=0)
        held_pages = max(held_pages, waiting_pages)
        moe_floor = self.total_experts if self.config.moe_backend == "resident" else self.expert_floor
        return Limits(
            floor={"moe": moe_floor, "kv": max(1, held_pages) * self.config.page_size, "mamba": max(1, len(running))},
            ceiling={"moe": self.total_experts, "kv": 2**62, "mamba": 2**31},
        )

    def reachable_ranges(self) -> dict[str, tuple[int, int]]:
        return reachable_ranges(self.geometry, self.unit_costs, self.budget.budget_bytes, self.limits())

    def plan_resize(
        self, moe: int | None = None, kv: int | None = None, mamba: int | None = None, held: bool = True
    ) -> Plan:
        """The plan from the current geometry to the target (None keeps a pool's size); with
        held=False, as if no request held pages or slots (would it fit once they finish?)."""
        g = self.geometry
        page = self.config.page_size
        target = Geometry(
            g.moe_slots if moe is None else moe,
            g.kv_tokens if kv is None else -(-kv // page) * page,
            g.mamba_slots if mamba is None else mamba,
        )
        return plan(g, target, self.unit_costs, self.budget.budget_bytes, self.limits(held))

    def rebuild(
        self, moe: int | None = None, kv: int | None = None, mamba: int | None = None,
        trigger: str = "manual", reason: str | None = None,
    ) -> dict:
        """Resize the pools live (None keeps a pool). Returns the history entry.

        Raises RebuildRefused (nothing touched) when the target is outside the reachable ranges,
        RebuildFailed after a rollback (the old geometry keeps serving).
        """
        p = self.plan_resize(moe, kv, mamba)
        if not p.fits:
            raise RebuildRefused(p.reason, self.reachable_ranges())
        entry = {
            "id": len(self.history), "time": time.time(), "trigger": trigger, "reason": reason,
            "from": sizes(p.current), "to": sizes(p.target), "peak_bytes": p.peak_bytes,
            "status": "ok", "error": None, "phases": {},
        }
        if p.target == p.current:
            return {**entry, "phases": {"total_s": 0.0}}
        try:
            entry["phases"] = {k: round(v, 6) for k, v in self.rebuilder.run(p).items()}
            entry["measured_peak_bytes"] = self.rebuilder.measured_peak_bytes
        except RebuildFailed as e:
            entry.update(status="rolled_back", error=str(e), measured_peak_bytes=self.rebuilder.measured_peak_bytes)
            self.history.append(entry)
            raise
        self.geometry = p.target
        assert geometry_of(self) == self.geometry, (geometry_of(self), self.geometry)
        self.history.append(entry)
        return entry

    # ----------------------------------------------------------------------------- reports
    def describe(self) -> dict:
        """What was measured and chosen at startup (printed by the CLI, served by the admin API)."""
        g, c, b = self.geometry, self.unit_costs, self.budget
        return {
            "model": str(self.model_path),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "budget": b.__dict__,
            "unit_costs": c.__dict__,
            "geometry": g.__dict__,
            "resident_weight_bytes": self.model.resident_bytes,
            "context_limit": self.context_limit,
            "expert_floor": self.expert_floor,
            "total_experts": self.total_experts,
        }


def _stand_in_tokenizer() -> Path:
    """The demo's tokenizer files alone (for synthetic checkpoints, which have none)."""
    from ft.engine.demo import default_cache_dir, write_tokenizer_files

    path = default_cache_dir() / "demo-tokenizer-v1"
    if not (path / "tokenizer.json").is_file():
        write_tokenizer_files(path)
    return path


class RebuildRefused(ValueError):
    """A target outside the reachable ranges: refused before any memory is touched."""

    def __init__(self, reason: str, ranges: dict[str, tuple[int, int]]) -> None:
        shown = ", ".join(f"{p} {lo}..{hi}" for p, (lo, hi) in ranges.items())
        super().__init__(f"{reason}; reachable ranges: {shown}")
        self.ranges = ranges


def _device(spec: str) -> torch.device:
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            from ft.engine.errors import ConfigError

            raise ConfigError("--device cuda asked but no CUDA device is available")
        if dev.index is None:  # name the device: memory queries and VMM need an index
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


__all__ = ["Engine", "MemoryBudget", "RebuildFailed", "RebuildRefused", "resolve_model_path"]
