"""What every rank of an engine builds: the model (its shard), the pools, the model runner.

`Engine` (rank 0: scheduler, sampler, ladder, tokenizer) and `TPWorker` (tensor-parallel ranks
1..: they only run the forward passes and rebuilds rank 0 sends) share this construction, so
that each rank measures its own budget and unit costs and sizes its pools the same way.
"""

from __future__ import annotations

import dataclasses

import logging
import os

import torch

from ft.memory.budget import (card_bytes, default_prefill_length, experts_can_all_be_resident, measure_budget,
                              streamed_prefill_length)
from ft.engine.cache.manager import CacheManager, PoolShapes, SizingOptions
from ft.engine.base.engine_config import EngineConfig, default_running_requests
from ft.engine.sched.ladder import make_rungs
from ft.engine.ranks.loader import DTYPES, activation_reserve, load_model, planned_host_bytes, tables_fit_on_disk
from ft.engine.ranks.model_source import model_source
from ft.engine.worker.buffers import RowsBuffer
from ft.engine.worker.model_runner import ModelRunner
from ft.engine.worker.prefill_graphs import CoreBuffers
from ft.engine.worker.routing_override import TraceRouting, trace_params, trace_popularity_seed
from ft.units import format_bytes
from ft.errors import ConfigError
from ft.memory.kv_pool import NVFP4_KV
from ft.memory.host_memory import HostPlan, available_bytes
from ft.memory.prefill_stream import PAGES, STREAM_PAGE_EXPERTS, PrefillStream
from ft.kernels.moe import DECODE_MAX_TOKENS, moe_pools_workspace_bytes, moe_workspace_bytes
from ft.kernels.backend import uses_triton
from ft.model.config import ModelConfig, read_quantization
from ft.model.kernel_support import check_kernel_shapes, nvfp4_formats, read_through_refusal

log = logging.getLogger("ft.engine")

LOAN_KEEP_TOKENS = 2048
"""--lend-prefill-reserve: steps of at most this many tokens run within the reserve the loan leaves (a
chat turn's prompt, the warm-up's short prompts); a longer one recalls the loan first."""

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": NVFP4_KV}
"""--kv-cache-dtype -> the KV pool's dtype ("auto": `RankState._kv_dtype`; nvfp4: `ft.memory.kv_pool.NVFP4_KV`)."""

KV_ALGO_DTYPES = {"FP8": torch.float8_e4m3fn, "NVFP4": NVFP4_KV}
"""A checkpoint's kv_cache_quant_algo (ModelOpt) -> the KV dtype its KV scales describe."""


def rank_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: --dtype, or with auto bf16 on CUDA and fp32 on the CPU."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def host_plan(config: EngineConfig, source, model_config: ModelConfig, dtype: torch.dtype,
              host_embedding: bool) -> tuple[HostPlan, bool]:
    """(What loading will keep in host memory against what the host has, whether an n-gram table is read from
    the checkpoint's files instead of held): `--ngram-table` as asked, or with auto from disk where the plan
    with the table in memory does not fit (and the table can be read from disk). ConfigError for host / disk
    on a model without a table. Computed from the checkpoint's headers (a synthetic config's shapes), before
    anything loads."""
    in_memory = HostPlan(planned_host_bytes(source, model_config, dtype, host_embedding), available_bytes())
    has_table = model_config.is_flash_next and bool(model_config.flash_next.ple_layers)
    if config.ngram_table != "auto":
        if not has_table:
            raise ConfigError(f"--ngram-table {config.ngram_table}: this model has no n-gram table")
        on_disk = config.ngram_table == "disk"
    else:  # (a synthetic table the temporary directory cannot hold stays in memory: the plan's check says so)
        on_disk = has_table and not in_memory.fits() and tables_fit_on_disk(source, model_config, dtype)
        if on_disk:
            log.info("n-gram table: read from the checkpoint's files through the page cache (--ngram-table auto): "
                     "with it, host memory would hold %s (%s) of %s available", format_bytes(in_memory.total),
                     in_memory.parts_text(), format_bytes(in_memory.available[0]))
    if not on_disk:
        return in_memory, False
    return HostPlan({what: n for what, n in in_memory.parts.items() if what != "n-gram table"},
                    in_memory.available), True


class RankState:
    """config, device, dtype, model_path, model_config (the whole model's), model (this rank's
    shard; its `cfg` is the shard's config), cache (the cache manager), reserve (activation
    bytes), rungs (the KV ladder's, or None), runner; tp: the tensor-parallel group or None."""

    def __init__(self, config: EngineConfig, tp=None) -> None:
        self.config, self.tp = config, tp
        self.device = rank_device(config.device, tp.rank if tp is not None else None)
        if config.max_running_requests is None:  # by the backend and the device (every rank decides alike)
            config = self.config = dataclasses.replace(
                config, max_running_requests=default_running_requests(self.device, config.moe_backend))
        chunk_by_card = config.max_prefill_length is None
        if chunk_by_card:  # by the card (every rank sees the same size); offloaded, again below
            config = self.config = dataclasses.replace(
                config, max_prefill_length=default_prefill_length(self.device, config.gpu_memory_limit))
        self.dtype = rank_dtype(config, self.device)
        self.source = model_source(config.model)
        self.model_path = self.source.path
        self.model_config = ModelConfig.from_file(self.model_path, config.model_override_fields)
        read_through = self._check_kernels(config)  # before the weights load: a refusal is at once
        if config.embedding_on_host and self.model_config.tie_word_embeddings:
            raise ConfigError("--embedding-on-host: this checkpoint ties its embedding to the output head "
                              "(tie_word_embeddings), which every step reads whole; it stays on the device")
        host_embedding = config.embedding_host(self.device.type) and tp is None \
            and not self.model_config.tie_word_embeddings
        # what stays in host memory, against what the host has: a refusal before minutes of loading (under tensor
        # parallelism rank 0 checked it before any worker started: `ft.engine.ranks.tp_worker.start_workers`)
        self.host_plan, tables_on_disk = host_plan(config, self.source, self.model_config, self.dtype, host_embedding)
        if config.host_memory_check and tp is None:
            self.host_plan.check()
        self.model, host_experts = load_model(self.source, self.model_config, self.dtype,
                                              self.device, config.seed, config.progress and (tp is None or tp.is_leader),
                                              tp, host_embedding, tables_on_disk)
        cfg = self.model.cfg  # this rank's heads and intermediate sizes (the whole model's on one GPU)
        if tp is not None:  # before the budget is measured: its buffers are device memory too
            why = tp.enable_one_shot(self.dtype)
            if why is not None and os.environ.get("FT_TP_ALL_REDUCE") == "one-shot" and tp.is_leader:
                log.warning("tensor parallelism: all-reduces stay on NCCL (one-shot path off: %s)", why)
        if not self.model.graph_safe and not config.disable_cuda_graph:
            config = self.config = dataclasses.replace(config, disable_cuda_graph=True)
            log.info("%s runs eagerly: its steps are not captured in CUDA graphs yet", cfg.architecture)
        prefill_graphs = not config.disable_cuda_graph and self.model.prefill_graph_safe
        self.context_limit = config.max_seq_len_override or cfg.context_length
        if cfg.is_flash_next and config.page_size % cfg.flash_next.indexer_compress_ratio:
            raise ConfigError(f"--page-size {config.page_size}: QSA's blocks of {cfg.flash_next.indexer_compress_ratio} "
                              "tokens must not straddle pages (a multiple of it)")
        shapes = PoolShapes(
            config.page_size, len(cfg.full_attention_layers), cfg.num_key_value_heads, cfg.head_dim,
            len(cfg.linear_attention_layers), cfg.linear_conv_dim, cfg.linear_conv_kernel_dim,
            cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, self.dtype, self.device,
            host_experts, self._kv_dtype(config), self.model.slot_states, self.model.index_key_dim,
        )
        # --disable-moe-prefill-overlap: one staging page, so each page's copies wait for the pass before
        self.prefill_stream_pages = 1 if config.disable_moe_prefill_overlap else PAGES
        self.prefill_stream_experts = self._stream_experts(config, host_experts)
        if chunk_by_card and self.prefill_stream_experts and self.device.type == "cuda":  # streamed: by its reserve
            streamed = streamed_prefill_length(card_bytes(self.device, config.gpu_memory_limit),
                                               lambda tokens: self._chunk_reserve(tokens, shapes.kv_dtype))
            if streamed > config.max_prefill_length:
                config = self.config = dataclasses.replace(config, max_prefill_length=streamed)
        self.reserve = activation_reserve(cfg, self.dtype, self.device,
                                          min(config.max_prefill_length, self.context_limit),
                                          config.max_running_requests, shapes.kv_dtype, self.context_limit)
        # one-request prefills up to this many tokens replay CUDA graphs (`ft.engine.worker.prefill_graphs`),
        # whose memory pool (the largest bucket's activations) and core buffers stay allocated
        self.prefill_graph_tokens = 0 if self.device.type != "cuda" or not prefill_graphs or tp is not None \
            else min(config.prefill_graph_max_tokens, config.max_prefill_length, self.context_limit)
        # (apart from `reserve`, which the eager forward's transients may use: this memory stays held)
        self.prefill_graph_reserve = 0 if not self.prefill_graph_tokens else \
            activation_reserve(cfg, self.dtype, self.device, self.prefill_graph_tokens, 1, shapes.kv_dtype, 0) \
            + CoreBuffers.nbytes(self.prefill_graph_tokens, cfg.num_attention_heads, cfg.num_key_value_heads,
                                 cfg.head_dim, self.dtype)
        # the decode graphs' shared pool holds the largest bucket's step (activations, MoE workspace,
        # logits) for as long as the graphs live: counted like the prefill graphs', beside `reserve`
        self.decode_graph_bs = config.decode_graph_max_bs if self.device.type == "cuda" else 0
        self.decode_graph_reserve = 0 if not self.decode_graph_bs else \
            activation_reserve(cfg, self.dtype, self.device, self.decode_graph_bs, self.decode_graph_bs,
                               shapes.kv_dtype, 0)
        # streamed prefill (offload): the staging pages and the passes' per-pair outputs of a whole chunk
        self.prefill_stream_reserve = 0
        if self.prefill_stream_experts:
            pages = self.prefill_stream_pages
            self.prefill_stream_reserve = PrefillStream.bytes_for(host_experts, self.prefill_stream_experts // pages,
                                                                  pages) \
                + self._stream_workspace(config.max_prefill_length)
        # --lend-prefill-reserve: what of the chunk's reserve (activations, streamed passes' workspace) chunks
        # of at most `loan_keep_tokens` leave unused; the expert slots borrow it (`CacheManager.lend`)
        self.loan_keep_tokens = min(LOAN_KEEP_TOKENS, config.max_prefill_length)
        self._reserve_kv_dtype = shapes.kv_dtype
        self.loan_bytes = 0
        if config.lends_reserve(self.device.type) and tp is None and self.loan_keep_tokens < config.max_prefill_length:
            self.loan_bytes = self._idle_reserve(self.loan_keep_tokens)
        # a paged n-gram table's step rows (`RowsBuffer`, the model runner's, allocated after the budget is measured)
        self.step_rows_bytes = RowsBuffer.device_bytes(self.model, config.max_prefill_length + config.max_running_requests)
        others = self.reserve + self.decode_graph_reserve + self.prefill_stream_reserve + self.step_rows_bytes
        # the default headroom's cap where it buys expert slots (`headroom_for`)
        capped = config.moe_backend == "offload" and tp is None
        budget = measure_budget(self.device, self.model.resident_bytes, config.memory_ratio, config.gpu_memory_limit,
                                others, config.cache_budget, capped)
        # NOTE: prefill graphs replay only while every expert is resident: a cache that can never hold them
        # all (offloaded on a small card) takes neither their reserve nor their solo prefill steps
        expert_bytes = 0 if host_experts is None else \
            sum(t.numel() * t.element_size() for t in host_experts if t is not None)
        if self.prefill_graph_tokens and host_experts is not None and not experts_can_all_be_resident(
                config.moe_backend, config.moe_cache_size, shapes.total_experts, expert_bytes, budget.budget_bytes):
            log.info("prefill graphs off: the expert cache can never hold every expert (%s of experts, a cache "
                     "budget of %s)", format_bytes(expert_bytes), format_bytes(budget.budget_bytes))
            self.prefill_graph_tokens = self.prefill_graph_reserve = 0
        if self.prefill_graph_reserve:
            budget = measure_budget(self.device, self.model.resident_bytes, config.memory_ratio,
                                    config.gpu_memory_limit, others + self.prefill_graph_reserve, config.cache_budget,
                                    capped)
        self.rungs = make_rungs(config.ladder_step_size, self.context_limit, config.page_size) \
            if config.enable_kv_ladder else None
        floor = min(cfg.num_experts_per_tok, shapes.total_experts) if shapes.total_experts else 0
        rungs = self.rungs
        self.cache = CacheManager(shapes, budget, SizingOptions(
            self.context_limit, config.mamba_slots_for(self.device.type),
            rungs[0] if rungs else config.num_tokens, config.moe_backend,
            config.moe_cache_size, None if config.storage_backend == "auto" else config.storage_backend,
            # the CPU "card" is host memory other processes share; past every running request at the
            # whole context the KV could never be used. NOTE: not under tensor parallelism: each rank's
            # budget differs by what rank 0 alone holds, and the ranks' KV sizes must be equal
            # (`join_ranks`); filling needs the ranks' smallest fit agreed first (not built yet)
            kv_fill_limit=config.max_running_requests * self.context_limit
            if self.device.type == "cuda" and tp is None else 0,
            loan_bytes=self.loan_bytes,
        ), floor)
        pools = self.cache.pools
        if pools.kv.scales is not None and pools.kv.kv.dtype == self._checkpoint_kv_dtype():  # its KV scales
            pools.kv.scales.copy_(self.model.kv_scales)
        elif pools.kv.scales is not None:  # a quantized cache without scales: the first prefill sets them
            pools.kv.calibrate_next_prefill = config.kv_scale_calibration
        if pools.experts is not None:
            through = config.moe_backend == "offload" and config.expert_read_through and read_through
            pools.experts.policy = config.expert_policy_for(through)
            if through:
                pools.experts.enable_read_through(cfg.num_experts_per_tok * config.max_running_requests,
                                                  mapped_victims=config.mapped_victims_for(through))
            if self.prefill_stream_experts:
                pools.experts.enable_prefill_stream(self.prefill_stream_experts // self.prefill_stream_pages,
                                                    pages=self.prefill_stream_pages,
                                                    min_tokens=DECODE_MAX_TOKENS + 1)
        self.runner = ModelRunner(
            self.model, pools, self.device, config.max_running_requests, config.max_prefill_length,
            -(-self.context_limit // config.page_size), self.context_limit,
            self.decode_graph_bs,
            self.prefill_graph_tokens,
            config.decode_graph_buckets,
        )
        self.runner.routing = self._trace_routing(config, cfg)
        if tp is not None:
            self.runner.attach_tp(tp)

    def _idle_reserve(self, tokens: int) -> int:
        """Bytes of the prefill chunk's reserve (activations, and the streamed passes' workspace) that a
        step of `tokens` tokens leaves unused."""
        chunk = self.config.max_prefill_length
        if tokens >= chunk:
            return 0
        idle = self.reserve - activation_reserve(self.model.cfg, self.dtype, self.device,
                                                 min(tokens, self.context_limit), self.config.max_running_requests,
                                                 self._reserve_kv_dtype, self.context_limit)
        if self.prefill_stream_experts:
            idle += self._stream_workspace(chunk) - self._stream_workspace(tokens)
        return max(0, idle)

    def loan_beside(self, tokens: int) -> int:
        """--lend-prefill-reserve: bytes of the loan that may stay out while a step of `tokens` tokens runs
        (all of it up to `loan_keep_tokens`, none at the whole chunk): what that step leaves of the reserve
        unused, at most `loan_bytes`."""
        if not self.loan_bytes:
            return 0
        return min(self.loan_bytes, self._idle_reserve(max(tokens, self.loan_keep_tokens)))

    def _stream_workspace(self, tokens: int) -> int:
        """Bytes the streamed passes' per-pair outputs of a chunk of `tokens` tokens take beyond the
        grouped MoE's own workspace (which the activation reserve counts)."""
        cfg = self.model.cfg
        dims = (min(tokens, self.context_limit), cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                torch.finfo(self.dtype).bits // 8)
        return max(0, moe_pools_workspace_bytes(*dims) - moe_workspace_bytes(*dims))

    def _chunk_reserve(self, tokens: int, kv_dtype) -> int:
        """What a streamed prefill chunk of `tokens` tokens reserves: its activations (at the
        configured running requests) and its passes' workspace."""
        return activation_reserve(self.model.cfg, self.dtype, self.device, min(tokens, self.context_limit),
                                  self.config.max_running_requests, kv_dtype, self.context_limit) \
            + self._stream_workspace(tokens)

    def _stream_experts(self, config: EngineConfig, host_experts) -> int:
        """Staging slots of streamed prefill (a multiple of its pages, `prefill_stream_pages`; 0: off):
        offload only, --prefill-stream-experts, by default min(64, experts per layer) slots a page (three
        pages, or one with --disable-moe-prefill-overlap) on CUDA and none on the CPU (its host store is
        the device's memory: there is no bus to overlap)."""
        if config.moe_backend != "offload" or host_experts is None:
            return 0
        pages = self.prefill_stream_pages
        n = config.prefill_stream_experts
        if n is None:
            n = pages * min(STREAM_PAGE_EXPERTS, host_experts.w13.shape[1]) if self.device.type == "cuda" else 0
        return n // pages * pages

    def _check_kernels(self, config: EngineConfig) -> bool:
        """The checkpoint's shapes against the kernels (`ft.model.kernel_support`): a shape no path runs
        raises (one line); `kernel_fallbacks` holds the lines of the slower paths it takes (ft serve's
        startup summary shows them). Returns whether offloaded decode may read missing experts through."""
        synthetic = self.source.synthetic  # (NVFP4 weights made from config.json alone)
        nvfp4, kv_nvfp4 = (True, False) if synthetic else nvfp4_formats(read_quantization(self.model_path))
        kv_nvfp4 = config.kv_cache_dtype == "nvfp4" or (config.kv_cache_dtype == "auto" and kv_nvfp4)
        triton = uses_triton(self.device)
        offload_rt = config.moe_backend == "offload" and config.expert_read_through
        self.kernel_fallbacks = check_kernel_shapes(self.model_config, device_type="cuda" if triton else "cpu",
                                                    quantized=nvfp4, kv_nvfp4=kv_nvfp4, read_through=offload_rt)
        why = read_through_refusal(self.model_config, quantized=nvfp4) if triton else None
        if why and offload_rt and config.expert_policy == "lfu":
            raise ConfigError(f"--expert-policy lfu needs read-through decode, which this model cannot take: {why}")
        return why is None

    def _checkpoint_kv_dtype(self) -> torch.dtype | None:
        """The KV dtype the checkpoint's KV scales describe: fp8, or NVFP4 when its ModelOpt
        kv_cache_quant_algo says NVFP4; None when it carries no KV scales."""
        if self.model.kv_scales is None:
            return None
        return KV_ALGO_DTYPES[getattr(self.model, "kv_cache_quant_algo", None) or "FP8"]

    def _kv_dtype(self, config: EngineConfig) -> torch.dtype:
        """The KV pool's dtype: the flag's; "auto" is the checkpoint's KV format when it carries KV
        scales (ModelOpt's kv_cache_quant_algo: FP8 -> fp8, NVFP4 -> nvfp4), else the compute dtype.
        Another dtype ignores such scales (they only describe the checkpoint's format: the pool's
        scales stay 1.0), and says so."""
        ckpt = self._checkpoint_kv_dtype()
        if config.kv_cache_dtype == "auto":
            return ckpt or self.dtype
        want = KV_DTYPES[config.kv_cache_dtype]
        if ckpt is not None and want != ckpt:
            log.info("the checkpoint's %s KV scales are not used: --kv-cache-dtype %s",
                     "NVFP4" if ckpt == NVFP4_KV else "FP8", config.kv_cache_dtype)
        return want

    def _trace_routing(self, config: EngineConfig, cfg) -> TraceRouting | None:
        """Synthetic models whose config has "routing_trace": experts from per-request traces."""
        if not self.source.synthetic or not cfg.moe_layers:
            return None
        spec = self.source.raw_config().get("routing_trace")
        params = trace_params(spec)
        if params is None:
            return None
        return TraceRouting(params, len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok, config.seed,
                            keep=4 * config.max_running_requests, device=self.device,
                            popularity_seed=trace_popularity_seed(spec, config.seed))


def rank_device(spec: str, rank: int | None = None) -> torch.device:
    """The device of `spec` ("auto", "cpu", "cuda", "cuda:N"); a tensor-parallel rank r on CUDA
    takes GPU r (CUDA_VISIBLE_DEVICES chooses which GPUs those are)."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda asked but no CUDA device is available")
        if rank is not None:
            if rank >= torch.cuda.device_count():
                raise ConfigError(f"--tensor-parallel-size needs a GPU per rank: {torch.cuda.device_count()} visible")
            dev = torch.device("cuda", rank)
            torch.cuda.set_device(dev)
        elif dev.index is None:  # name the device: memory queries and VMM need an index
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev
