"""Admin API schemas: one module that the server, `ft ctl` and `ft top` all import.

Pydantic only (no torch). Sizes are in the units users see: moe and mamba in slots, kv in
tokens; bytes are plain ints. Every field a client reads has a default, so an older or partial
payload still parses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

State = Literal["starting", "serving", "rebuilding"]


def _integral(value: Any) -> Any:
    """45342.0 -> 45342: JSON has one number type, and JSON Schema's "integer" admits a number whose
    fraction is zero, so a request body may send it. Anything else passes unchanged to the (strict)
    int validation: true, "8" and 1.5 are still refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]
"""An int field of a strict request body: what its OpenAPI schema ("type": "integer") admits."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PoolState(_Model):
    """One pool: its size, bytes, and the reachable range [min, max] with the others held fixed."""

    size: int = 0
    bytes: int = 0
    min: int = 0
    max: int = 0


class MoEPoolState(PoolState):
    policy: str = "lru"
    backend: str = "offload"
    total_experts: int = 0
    resident: int = 0  # experts currently in slots
    hit_rate: float = 0.0  # since startup
    hits: int = 0
    misses: int = 0
    read_through: bool = False  # decode reads misses from host memory inside the step and lands them
    landed: int = 0  # experts cached by read-through landings since startup
    host_bytes: int = 0  # expert bytes read from host memory since startup (loads and in-place reads)
    lent_bytes: int = 0  # of `bytes`, what the slots borrow from the prefill reserve now (--lend-prefill-reserve)
    loan_bytes: int = 0  # what they may borrow while prompts are short (0: no loan)


class KVPoolState(PoolState):
    page_size: int = 64
    pages: int = 0
    used: int = 0  # pages held by requests or the prefix cache
    cached: int = 0  # of `used`, pages only the prefix cache holds (given back when a request needs them)
    dtype: str = ""  # the cache's dtype (--kv-cache-dtype)


class MambaPoolState(PoolState):
    used: int = 0  # slots held by requests or the prefix cache
    host_states: int = 0  # cached prefixes whose state is in host memory instead (--prefix-states-on-host)
    host_bytes: int = 0  # the host memory those states take
    on_demand_max: int = 0  # --mamba-on-demand: the pool grows for waiting requests up to this many slots (0: fixed)


class Pools(_Model):
    moe: MoEPoolState = Field(default_factory=MoEPoolState)
    kv: KVPoolState = Field(default_factory=KVPoolState)
    mamba: MambaPoolState = Field(default_factory=MambaPoolState)


class LadderState(_Model):
    enabled: bool = False
    auto: bool = False
    rungs: list[int] = Field(default_factory=list)
    current: int | None = None  # index into rungs, from 0 (ft ctl, ft top and the banner count rungs from 1)
    step: int = 0
    last_decision: str | None = None


class StorageState(_Model):
    """What backs the pools. vmm / mmap map and unmap at the tail (free before allocate);
    realloc copies, so a resize holds old and new at once and the ranges are narrower."""

    backend: str = "vmm"  # vmm | mmap | realloc
    granularity_bytes: int = 0  # each pool tensor's allocation rounds up to this
    reallocates: bool = False
    held_bytes: int = 0  # what the allocator holds now (measured)


class Exchange(_Model):
    """What one expert slot trades for, from the measured unit costs (bytes per slot, per KV token,
    per mamba slot): the ladder's and a resize's exchange rate."""

    kv_tokens_per_expert_slot: float = 0.0
    mamba_slots_per_expert_slot: float = 0.0


class RankCache(_Model):
    """One GPU of a tensor-parallel server: its own budget and pools (KV and mamba sizes are the
    same on every rank; expert slots follow each rank's budget), asked of every rank when the
    answer is built."""

    rank: int = 0
    budget_bytes: int = 0
    held_bytes: int = 0
    moe_slots: int = 0
    kv_tokens: int = 0
    mamba_slots: int = 0
    hits: int = 0  # this rank's expert cache (each rank caches its own part of every expert)
    misses: int = 0


class DeviceState(_Model):
    """The card by the driver's count (`ft.memory.device_memory`; all zero on the CPU and from servers
    before this field): the card the budget sees, what is in use, the caching allocator's peak, and the
    headroom the budget keeps back from the pools and the reserve (`ft.memory.budget.headroom_for`)."""

    card_bytes: int = 0
    used_bytes: int = 0
    allocator_peak_bytes: int = 0
    headroom_bytes: int = 0

    @property
    def untouched_bytes(self) -> int:
        """Of the card, what the server has not taken (never negative)."""
        return max(0, self.card_bytes - self.used_bytes)


class HostMemoryState(_Model):
    """What the server keeps in host memory as planned before it loaded, {what: bytes} (`ft.memory.host_memory.
    HostPlan`: routed experts, n-gram table, embedding, prefix states), and what the host had available then
    (None: unknown; servers before this field sent no parts)."""

    parts: dict[str, int] = Field(default_factory=dict)
    available_bytes: int | None = None
    available_from: str = ""


class CacheState(_Model):
    """GET /admin/cache. Each pool's [min, max] is its reachable range with the other pools held
    at their current sizes (`ranges_hold_others`); a target that changes several pools is checked
    as a whole (a dry run answers it)."""

    state: State = "starting"
    model: str = ""
    budget_bytes: int = 0
    allocated_bytes: int = 0
    context_limit: int = 0
    pools: Pools = Field(default_factory=Pools)
    ladder: LadderState = Field(default_factory=LadderState)
    running: int = 0
    waiting: int = 0
    admission: str = "open"  # "open", or "paused" while a resize waits for running requests (queued ones wait)
    uptime_s: float = 0.0  # monotonic within one server process: orders answers (ft top drops older ones)
    started_at: float = 0.0  # unix seconds the server process started (0: not serving yet); a new one is a restart
    storage: StorageState = Field(default_factory=StorageState)
    degraded: str | None = None  # a rebuild's rollback could not restore everything: what is left
    exchange: Exchange = Field(default_factory=Exchange)
    ranges_hold_others: bool = True  # each range holds the other pools at their current sizes
    notes: list[str] = Field(default_factory=list)  # about the request answered (e.g. KV rounded to pages)
    ranks: list[RankCache] = Field(default_factory=list)  # tensor parallelism: every GPU's pools (empty on one GPU)
    # weights kept in host memory beside the routed experts (Qwen3.8-Flash-Next's n-gram table, the token
    # embedding with --embedding-on-host): outside the cache budget, never traded by the ladder; each step
    # gathers the rows its tokens need. host_tables: what -> bytes (servers before this field sent none)
    host_table_bytes: int = 0
    host_tables: dict[str, int] = Field(default_factory=dict)
    # tables read from the checkpoint's files through the page cache instead (--ngram-table disk): what -> bytes
    disk_tables: dict[str, int] = Field(default_factory=dict)
    host_memory: HostMemoryState = Field(default_factory=HostMemoryState)
    device: DeviceState = Field(default_factory=DeviceState)


class ResizeRequest(_Model):
    """POST /admin/cache: targets (None keeps the current size), wait and dry run. Strict: `{"kv": true}`
    is refused, not read as a KV size of 1."""

    model_config = ConfigDict(extra="forbid", strict=True)

    moe: JsonInt | None = Field(default=None, ge=0)
    kv: JsonInt | None = Field(default=None, ge=0)
    mamba: JsonInt | None = Field(default=None, ge=0)
    wait_s: float | None = Field(default=None, ge=0, le=3600)
    dry_run: bool = False


class PlanStep(_Model):
    action: str  # e.g. "shrink kv", "grow moe"
    pool: str
    delta_bytes: int
    total_bytes: int  # running total after this step
    peak_bytes: int = 0  # the most held during this step (a reallocating backend holds old and new)


class ResizePlan(_Model):
    """A dry run's answer: the ordered steps, the peak and whether it fits the budget."""

    target: dict[str, int] = Field(default_factory=dict)
    steps: list[PlanStep] = Field(default_factory=list)
    peak_bytes: int = 0
    budget_bytes: int = 0
    fits: bool = False
    reason: str | None = None
    notes: list[str] = Field(default_factory=list)  # e.g. KV rounded up to whole pages
    # each pool's reachable [min, max] with the other pools at this target's sizes
    ranges: dict[str, list[int]] = Field(default_factory=dict)


class RebuildPhases(_Model):
    quiesce_s: float = 0.0
    free_s: float = 0.0
    allocate_s: float = 0.0
    fill_s: float = 0.0
    graphs_s: float = 0.0
    total_s: float = 0.0


class RankRebuild(_Model):
    """One GPU's part of a tensor-parallel rebuild: its pools' measured peak and where it landed."""

    rank: int = 0
    peak_bytes: int | None = None
    to: dict[str, int] = Field(default_factory=dict)
    error: str | None = None


class HistoryEntry(_Model):
    id: int = 0
    time: float = 0.0  # unix seconds
    trigger: Literal["startup", "manual", "ladder", "loan", "mamba"] = "manual"  # loan: --lend-prefill-reserve;
    # mamba: --mamba-on-demand
    reason: str | None = None
    from_: dict[str, int] = Field(default_factory=dict, alias="from")
    to: dict[str, int] = Field(default_factory=dict)
    peak_bytes: int = 0  # the plan's peak
    measured_peak_bytes: int = 0  # the pools' real bytes, largest after any step
    status: Literal["ok", "rolled_back", "degraded", "refused", "running"] = "ok"  # degraded: a rollback fell short
    error: str | None = None
    phases: RebuildPhases = Field(default_factory=RebuildPhases)
    ranks: list[RankRebuild] = Field(default_factory=list)  # tensor parallelism: every GPU's part

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class History(_Model):
    entries: list[HistoryEntry] = Field(default_factory=list)


class LiveRates(_Model):
    decode_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    expert_hit_rate: float = 0.0  # over the last interval
    kv_usage: float = 0.0  # used pages / pages
    engine_busy: float = 0.0  # share of the last interval the engine thread spent in steps, 0..1 (0 when unknown)
    slow_steps: int = 0  # steps in the last interval far slower than their kind's usual (each a warning in the server log)


class Event(_Model):
    """One server-sent event of GET /admin/events."""

    kind: Literal["snapshot", "change", "tick", "rebuild"] = "tick"
    cache: CacheState = Field(default_factory=CacheState)
    rates: LiveRates = Field(default_factory=LiveRates)
    rebuild: HistoryEntry | None = None


class RequestInfo(_Model):
    """One request of GET /admin/requests."""

    id: str = ""
    state: Literal["waiting", "prefill", "decode"] = "waiting"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    kv_pages: int = 0  # KV pages it holds now (pages shared with the prefix cache included)
    age_s: float = 0.0  # since it was queued


class RequestList(_Model):
    """GET /admin/requests: the running requests (batch order), then the waiting ones (queue order),
    at most `limit` of them; `running` and `waiting` count them all."""

    requests: list[RequestInfo] = Field(default_factory=list)
    running: int = 0
    waiting: int = 0
    truncated: bool = False  # more requests than the limit: the list is cut
    uptime_s: float = 0.0
    started_at: float = 0.0


class ErrorBody(_Model):
    """Every 4xx/5xx body: {"error": {"message", "type", "code"}} (OpenAI's shape)."""

    class Detail(_Model):
        message: str
        type: str = "invalid_request_error"
        code: int | str | None = None

    error: Detail
