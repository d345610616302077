"""Engine options: one frozen dataclass whose fields are the `ft serve` / `ft generate` flags
(with underscores), so each default lives in one place."""

from __future__ import annotations

import json

from dataclasses import dataclass, fields

from ft.errors import ConfigError
from ft.units import parse_bytes


KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")
"""--kv-cache-dtype values (the engine maps them to the pool's dtype: `ft.engine.core.engine.KV_DTYPES`)."""

MAMBA_ON_DEMAND_MIN = 1
"""--mamba-on-demand: the device mamba slots the pool keeps at least (one request chatting needs one)."""

EXPERT_POLICIES = ("auto", "lru", "lfu")
"""--expert-policy values (`EngineConfig.expert_policy_for` resolves auto)."""

RUNNING_REQUESTS_DEFAULT = 8
"""Requests decoded together when --max-running-requests is not given, except resident on a GPU. Why
small: on an offloaded card each running request's two mamba slots (147 MiB on the 80B) and its decode
graph rows come out of the expert slots, which set the decode speed at concurrency 1."""
RUNNING_REQUESTS_RESIDENT_GPU = 64
"""The same, with every expert resident on a GPU: nothing is traded away, and concurrency 32-64 is where
`ft serve` was measured (bench/RESULTS.md, issue 40's rows: 1,718 tok/s at 64 against one stream's 348)."""


def default_running_requests(device, moe_backend: str) -> int:
    """--max-running-requests when not given: `RUNNING_REQUESTS_RESIDENT_GPU` for the resident backend
    on a CUDA device, else `RUNNING_REQUESTS_DEFAULT`. `device`: a torch.device (its `type` is read)."""
    return RUNNING_REQUESTS_RESIDENT_GPU if device.type == "cuda" and moe_backend == "resident" \
        else RUNNING_REQUESTS_DEFAULT


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None or "demo": the built-in demo model
    tokenizer: str | None = None  # directory with tokenizer.json (+ tokenizer_config.json); None: the checkpoint's
    chat_template: str | None = None  # a Jinja file's path or the template text; None: the tokenizer's own
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    moe_backend: str = "offload"  # offload | resident
    moe_cache_size: int | None = None  # expert slots; None: auto
    moe_cache_auto: bool = False  # slots fill what the budget leaves after KV and mamba
    expert_policy: str = "auto"  # auto | lru | lfu: which resident experts make room for misses (`expert_policy_for`)
    expert_read_through: bool = True  # offloaded decode reads misses from host memory inside the step
    expert_mapped_victims: bool | None = None  # read-through: a victim stays a hit until a miss claims its slot;
    # None: on wherever decode reads misses through (`mapped_victims_for`)
    prefill_stream_experts: int | None = None  # offload: staging slots of streamed prefill (None: auto; 0: off)
    disable_moe_prefill_overlap: bool = False  # the seeds' flag: streamed prefill through one staging page, its
    # copies and the passes that read them in turn (no overlap; two pages' bytes go to expert slots)
    num_tokens: int | None = None  # KV capacity in tokens; None: the whole context if it fits
    kv_cache_dtype: str = "auto"  # auto (a checkpoint's KV format with its scales, else compute) | bf16 | fp8 | nvfp4
    kv_scale_calibration: bool = False  # a quantized KV cache without checkpoint scales: set them from the first prefill
    max_seq_len_override: int | None = None  # context limit instead of the checkpoint's (ModelConfig.context_length)
    model_overrides: str | None = None  # a JSON object merged over config.json (`model_config.merge_overrides`)
    memory_ratio: float | None = None  # None: the default headroom (`ft.memory.budget.headroom_for`)
    gpu_memory_limit: int | str | None = None  # bytes or "16GiB": act as if the card were this big
    cache_budget: int | str | None = None  # cap the cache pools' budget (benchmarks emulating a card)
    page_size: int = 64
    max_running_requests: int | None = None  # None: `default_running_requests` (64 resident on a GPU, else 8)
    max_prefill_length: int | None = None  # tokens per prefill chunk (None: by the card, default_prefill_length)
    mamba_cache_size: int | None = None  # device mamba slots; None: `mamba_slots_for`
    enable_prefix_cache: bool = True
    prefix_states_on_host: bool | None = None  # prefix-cache entries' linear-attention states in pinned host
    # memory; None: when experts are offloaded on one CUDA GPU (`prefix_host_entries`)
    lend_prefill_reserve: bool | None = None  # expert slots borrow the prefill reserve's idle part
    # (`ft.engine.sched.loan`); None: when an offloaded cache fills the budget on one CUDA GPU (`lends_reserve`)
    loan_hold_s: float = 0.0  # seconds with no long step and no long prompt pending before the loan goes out
    # again (`ReserveLoan.hold_s`; 0: at the first plain step after it, the measured best, ft.engine.sched.loan)
    mamba_on_demand: bool = False  # device mamba slots for the running requests only, grown when one waits
    # for a slot and given back to expert slots when idle (`ft.engine.sched.mamba_demand`); offloaded, one GPU
    enable_kv_ladder: bool = False  # grow KV rung by rung when a request needs it, shrink back later
    ladder_step_size: int = 32768  # tokens between rungs; the first rung is twice this
    ladder_min_reuse: float = 0.5  # a request reusing less of its prompt from the cache may shrink KV
    ladder_dwell_s: float = 30.0  # least seconds on a rung before shrinking
    ladder_grow_hold_s: float = 60.0  # no shrink for this many seconds after a grow
    cuda_graph_max_bs: int | None = None  # decode batches up to this size replay CUDA graphs (on CUDA); None: all
    # (up to max_running_requests; `decode_graph_max_bs`)
    cuda_graph_bs: str | None = None  # the decode graphs' batch sizes, "1,2,4,8" (SGLang's --cuda-graph-bs); None:
    # `decode_graphs.batch_buckets`' ladder up to `decode_graph_max_bs` (`decode_graph_buckets`)
    disable_cuda_graph: bool = False  # run every decode step and prefill eagerly (debugging)
    prefill_graph_max_tokens: int = 2048  # one-sequence prefills up to this many tokens replay CUDA graphs
    mix_prefill_decode: bool = True  # a prefill step carries a token of each decoding request (ft.engine.sched.scheduler)
    max_mixed_prefill_length: int | None = None  # prompt tokens of a step that also decodes (None: --max-prefill-length)
    overlap_decode: bool | None = None  # queue the next decode step before reading this one's tokens; None: on CUDA
    embedding_on_host: bool | None = None  # the token embedding in pinned host memory; None: when offloading on CUDA
    storage_backend: str = "auto"  # auto | vmm | mmap | realloc: how pools grow and shrink (see ft.memory.storage)
    host_memory_check: bool = True  # refuse before loading when the host-memory tables do not fit (ft.memory.host_memory)
    ngram_table: str = "auto"  # auto | host | disk: where an n-gram table lives (ft.model.paged_table)
    seed: int = 0
    progress: bool = False  # show loading progress
    tensor_parallel_size: int = 1  # GPUs sharing the model (heads and expert channels split, one process each)

    def expert_policy_for(self, read_through: bool) -> str:
        """The policy the expert cache runs: the one asked, or with "auto" LFU with aging when offloaded
        decode reads misses through (`ft.memory.read_through`), LRU otherwise (the classic path loads
        misses before each layer, by recency only). Why LFU: `bench/offload_policy.py` (the real cache and
        policy on calibrated routing, whose LRU hit rates match the H200's within 0.3 points) gives it
        +0.2 / +0.5 / +6.9 / +6.6 points of hits at 14,116 / 7,600 / 2,008 / 1,299 slots (the 32 GiB and
        16 GiB cards), and the H200 measured it +5-9% tok/s on a 16 GiB card (session 9, bench/RESULTS.md)."""
        if self.expert_policy != "auto":
            return self.expert_policy
        return "lfu" if read_through else "lru"

    def __post_init__(self) -> None:
        if self.moe_backend not in ("offload", "resident"):
            raise ConfigError(f"--moe-backend must be offload or resident, got {self.moe_backend!r}")
        if self.moe_backend == "resident" and self.moe_cache_size is not None:
            raise ConfigError("--moe-cache-size applies to --moe-backend offload (resident keeps every expert)")
        if self.moe_cache_auto and self.moe_cache_size is not None:
            raise ConfigError("--moe-cache-auto and --moe-cache-size exclude each other")
        if self.expert_policy not in EXPERT_POLICIES:
            raise ConfigError(f"--expert-policy must be {', '.join(EXPERT_POLICIES)}, got {self.expert_policy!r}")
        if self.expert_policy == "lfu" and not self.expert_read_through:
            raise ConfigError("--expert-policy lfu needs read-through decode (loads before each layer are LRU)")
        if self.expert_mapped_victims and not (self.expert_read_through and self.moe_backend == "offload"):
            raise ConfigError("--expert-mapped-victims needs --moe-backend offload with read-through decode")
        if self.prefill_stream_experts is not None and self.prefill_stream_experts < 0:
            raise ConfigError(f"--prefill-stream-experts must be >= 0, got {self.prefill_stream_experts}")
        if self.disable_moe_prefill_overlap and self.moe_backend != "offload":
            raise ConfigError("--disable-moe-prefill-overlap: only an offloaded MoE streams experts during prefill "
                              "(--moe-backend resident holds them all)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.storage_backend not in ("auto", "vmm", "mmap", "realloc"):
            raise ConfigError(f"--storage-backend must be auto, vmm, mmap or realloc, got {self.storage_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None:
            object.__setattr__(self, "cuda_graph_bs", _batch_sizes(self.cuda_graph_bs))
        if self.prefill_graph_max_tokens < 0:
            raise ConfigError(f"--prefill-graph-max-tokens must be >= 0, got {self.prefill_graph_max_tokens}")
        if self.max_seq_len_override is not None and self.max_seq_len_override < 1:  # (0 read as "none" before)
            raise ConfigError(f"--max-model-len must be >= 1 (leave it out for the checkpoint's context), got "
                              f"{self.max_seq_len_override}")
        if self.memory_ratio is not None and not 0 < self.memory_ratio <= 1:  # (before anything loads or listens)
            raise ConfigError(f"--memory-ratio must be in (0, 1], got {self.memory_ratio}")
        for name in ("page_size", "max_running_requests", "max_prefill_length", "max_mixed_prefill_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.embedding_on_host and self.tensor_parallel_size > 1:
            raise ConfigError("--embedding-on-host runs on one GPU (tensor parallelism splits the embedding "
                              "between the GPUs instead)")
        if self.prefix_states_on_host and self.tensor_parallel_size > 1:
            raise ConfigError("--prefix-states-on-host runs on one GPU (tensor-parallel ranks keep the states "
                              "in device slots)")
        if self.prefix_states_on_host and not self.enable_prefix_cache:
            raise ConfigError("--prefix-states-on-host needs the prefix cache (drop --no-enable-prefix-cache)")
        if self.loan_hold_s < 0:
            raise ConfigError(f"the loan's hold must be >= 0 seconds, got {self.loan_hold_s}")
        if self.lend_prefill_reserve and (self.moe_backend != "offload" or self.moe_cache_size is not None
                                          or self.tensor_parallel_size > 1):
            raise ConfigError("--lend-prefill-reserve lends to an offloaded expert cache that fills the budget, on "
                              "one GPU (no --moe-backend resident, --moe-cache-size or tensor parallelism)")
        if self.mamba_on_demand and (self.moe_backend != "offload" or self.moe_cache_size is not None
                                     or self.mamba_cache_size is not None or self.tensor_parallel_size > 1
                                     or (self.enable_prefix_cache and self.prefix_states_on_host is False)):
            raise ConfigError("--mamba-on-demand trades linear-attention state slots with an offloaded expert cache "
                              "that fills the budget, on one GPU, with the prefix cache's states in host memory (no "
                              "--moe-backend resident, --moe-cache-size, --mamba-cache-size, tensor parallelism or "
                              "--no-prefix-states-on-host)")
        if self.enable_kv_ladder and self.num_tokens is not None:
            raise ConfigError("--num-tokens conflicts with --enable-kv-ladder: the ladder sets the KV size "
                              "(use --ladder-step-size; KV starts at twice the step)")
        if self.model_overrides is not None:
            self.model_override_fields  # (its ConfigError, at once: not when the engine starts to load)
        for name in ("gpu_memory_limit", "cache_budget"):
            if getattr(self, name) is not None:
                try:
                    object.__setattr__(self, name, parse_bytes(getattr(self, name)))
                except ValueError as e:
                    raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None

    @property
    def model_override_fields(self) -> dict | None:
        """--model-overrides as a dict (None: none given). Raises ConfigError (one line) for text that is not a
        JSON object."""
        if self.model_overrides is None:
            return None
        try:
            value = json.loads(self.model_overrides)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--model-overrides: not JSON ({e.msg} at character {e.pos}): "
                              f"{self.model_overrides[:80]!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"--model-overrides: a JSON object of config.json fields is needed, "
                              f"got {type(value).__name__}")
        return value

    @property
    def running_requests(self) -> int:
        """max_running_requests as given, or before the engine decides it (None) the smaller default, 8."""
        return self.max_running_requests or RUNNING_REQUESTS_DEFAULT

    @property
    def decode_graph_max_bs(self) -> int:
        """The largest decode batch replayed from a CUDA graph: --cuda-graph-max-bs, by default every
        batch the engine runs (max_running_requests); 0 with --disable-cuda-graph."""
        if self.disable_cuda_graph:
            return 0
        limit = self.running_requests if self.cuda_graph_max_bs is None else self.cuda_graph_max_bs
        if self.cuda_graph_bs is not None:
            limit = min(limit, self._graph_sizes()[-1])
        return min(limit, self.running_requests)

    @property
    def decode_graph_buckets(self) -> tuple[int, ...] | None:
        """The decode graphs' batch sizes as --cuda-graph-bs gave them (those up to `decode_graph_max_bs`),
        or None for `decode_graphs.batch_buckets`' ladder."""
        if self.cuda_graph_bs is None:
            return None
        return tuple(b for b in self._graph_sizes() if b <= self.decode_graph_max_bs)

    def _graph_sizes(self) -> tuple[int, ...]:
        """--cuda-graph-bs as sorted integers (the field keeps `_batch_sizes`' normalized text)."""
        return tuple(int(v) for v in self.cuda_graph_bs.split(","))

    def mapped_victims_for(self, read_through: bool) -> bool:
        """Whether read-through keeps a victim mapped (a hit) until a miss claims its slot: as asked, by
        default whenever decode reads misses through. Why on: the H200 measured +1.5 / +3.8 points of hits
        and +1.6% / +4.6% tokens/s at 1,024 tokens on the 16 GiB card (Qwen3.8-Flash-Next, 2,008 / 1,299
        slots) and +0.2 points, +2.3-4.5% on the 32 GiB card (Qwen3-Next-80B, 14,116 slots): bench/RESULTS.md,
        session 33."""
        return read_through if self.expert_mapped_victims is None else self.expert_mapped_victims and read_through

    def embedding_host(self, device_type: str) -> bool:
        """Whether the token embedding lives in pinned host memory: --embedding-on-host as given, by
        default when experts are offloaded on one GPU (each step gathers only its tokens' rows, a few
        KiB, and the card's bytes go to expert slots instead)."""
        if self.embedding_on_host is not None:
            return self.embedding_on_host
        return self.moe_backend == "offload" and device_type == "cuda" and self.tensor_parallel_size == 1

    def lends_reserve(self, device_type: str) -> bool:
        """Whether the expert slots borrow the prefill reserve's idle part (`ft.engine.sched.loan`):
        --lend-prefill-reserve as given, by default where it can (experts offloaded on one CUDA GPU, the
        cache's size not fixed by --moe-cache-size). Why on: the H200 measured +2.7% / +2.8% output tok/s
        through `ft serve` at concurrency 1 / 8 (Qwen3-Next-80B, 32 GiB card, 12,566 -> 13,948 slots) and
        +2.2% at concurrency 1 (Qwen3.8-Flash-Next, 16 GiB card, 1,607 -> 1,761 slots), and an 8K
        prompt's TTFT unchanged by its recall (2,912 against 2,909 ms): bench/RESULTS.md, session 35."""
        if self.lend_prefill_reserve is not None:
            return self.lend_prefill_reserve
        return self.moe_backend == "offload" and device_type == "cuda" and self.tensor_parallel_size == 1 \
            and self.moe_cache_size is None

    def prefix_host_entries(self, device_type: str) -> int:
        """Prefix-cache entries that keep their linear-attention state in pinned host memory (0: each
        holds a device mamba slot): --prefix-states-on-host as given, by default when experts are
        offloaded on one CUDA GPU, where the card's bytes are worth most as expert slots (a slot of
        Qwen3.8-Flash-Next's state, 113 MB, is ~40 expert slots). As many entries as the device pool
        held beside the running requests by default (`mamba_slots_for`)."""
        on = self.prefix_states_on_host
        if on is None:
            on = self.moe_backend == "offload" and device_type == "cuda" and self.tensor_parallel_size == 1
        return max(4, self.running_requests) if on and self.enable_prefix_cache else 0

    def mamba_slots_for(self, device_type: str) -> int:
        """Device mamba slots at startup: --mamba-cache-size, else one per running request plus as many for
        the prefix cache's entries (at least 4 in all), or with the entries' states in host memory
        (`prefix_host_entries`) the running requests' alone; with --mamba-on-demand MAMBA_ON_DEMAND_MIN
        (the pool grows when a request waits for a slot)."""
        if self.mamba_cache_size:
            return self.mamba_cache_size
        if self.mamba_on_demand:
            return MAMBA_ON_DEMAND_MIN
        if self.prefix_host_entries(device_type):
            return self.running_requests
        return max(4, 2 * self.running_requests)

    @classmethod
    def from_options(cls, **opts) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**opts)


def _batch_sizes(text: str) -> str:
    """--cuda-graph-bs "1, 2,4 8" -> "1,2,4,8" (sorted, each once). Raises ConfigError (one line) for a
    size that is not a positive integer or an empty list."""
    parts = str(text).replace(",", " ").split()
    try:
        sizes = sorted({int(p) for p in parts})
    except ValueError:
        raise ConfigError(f"--cuda-graph-bs takes batch sizes such as 1,2,4,8, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--cuda-graph-bs takes batch sizes of at least 1, got {text!r}")
    return ",".join(map(str, sizes))
