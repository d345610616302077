"""`ft serve`: the daemon.

Startup, in order: the flags and what they name are checked (model directory, config.json's
architecture and shapes, tokenizer, chat template) and the port is bound, so that a user error is one
line and a non-zero exit before anything loads or listens; then HTTP comes up (/health answers 503
while the engine loads on its thread) and, once the engine is up and /health answers 200, the
banner ends with "ready on http://HOST:PORT".
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import threading
import time

from ft.engine_args import add_engine_args, engine_config_from_args
from ft.units import format_bytes, host_plan_text, host_tables_text

log = logging.getLogger("ft.serve")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       usage="%(prog)s [MODEL] [options]",
                       description="Serve a model over an OpenAI-compatible HTTP API with admin routes. "
                                   "vLLM's and SGLang's names of the common flags work too (--max-model-len, "
                                   "--max-num-seqs, --gpu-memory-utilization, ...: see each flag).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind: 127.0.0.1 is this machine only; "
                   "0.0.0.0 is every interface (set --api-key and --admin-token first)")
    p.add_argument("--port", type=int, default=30000, help="TCP port to listen on (0: any free port)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: ft-demo or the folder name)")
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1 routes (visible in ps: prefer "
                   "$FT_API_KEY or --api-key-file) (default: $FT_API_KEY, else no key)")
    p.add_argument("--api-key-file", default=None, help="read the /v1 bearer key from this file (first line)")
    p.add_argument("--admin-token", default=None, help="require this bearer token on /admin routes (visible in ps: "
                   "prefer $FT_ADMIN_TOKEN or --admin-token-file) (default: $FT_ADMIN_TOKEN, else no token)")
    p.add_argument("--admin-token-file", default=None, help="read the /admin bearer token from this file (first line)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least level of the log lines, FreeToken's (ft.*) and uvicorn's alike")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines, or one JSON object per line (time, level, logger, message)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="seconds between stats lines (running and waiting requests, prompt and generation tokens/s, "
                        "KV usage, expert hit rate, ladder rung), written while there is activity; 0: none")
    p.add_argument("--access-log-admin", action="store_true",
                   help="also log GET /health, /metrics and /admin/... in the access log (left out: monitors and "
                        "`ft top` poll them)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body accepted")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get to finish on shutdown")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may stall before the request is refused (408)")
    p.add_argument("--allow-client-chat-template", action="store_true",
                   help="let requests bring their own chat template (chat_template_kwargs.chat_template; sandboxed "
                        "Jinja, but it runs their code)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="before /health says ready, run throwaway requests so that every kernel is compiled and "
                        "every CUDA graph captured (prefill token buckets, decode batch buckets, sampling with "
                        "penalties, logprobs and a grammar): the first request is as fast as the hundredth. Triton "
                        "keeps what it compiled in ~/.triton/cache ($TRITON_CACHE_DIR), so a restart warms up "
                        "faster (default: on a GPU)")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="once the engine is up and warm, move every object startup made out of Python's garbage "
                        "collector's reach (gc.freeze): a full collection then walks only what serving makes, "
                        "not the model's and the libraries' objects, so it no longer pauses every thread "
                        "(the streams, /metrics) for tens of milliseconds")
    add_engine_args(p)
    p.set_defaults(func=run)


def secret(flag: str | None, path: str | None, env: str, name: str) -> str | None:
    """A token from its flag (warned about: `ps` shows it), its file (first line), or the environment."""
    from ft.errors import ConfigError

    if flag is not None and path is not None:
        raise ConfigError(f"{name} and {name}-file exclude each other")
    if path is not None:
        try:
            value = open(path, encoding="utf-8").readline().strip()
        except OSError as e:
            raise ConfigError(f"{name}-file: cannot read {path}: {e.strerror}") from None
        if not value:
            raise ConfigError(f"{name}-file: {path} is empty")
        return value
    if flag is not None:
        log.warning("%s on the command line is visible to every local user (ps); use $%s or %s-file", name, env, name)
        return flag
    return os.environ.get(env) or None


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_memory_lines(plan: dict) -> list[str]:
    """What loading kept in host memory against what the host had before it (`ft.memory.host_memory`)."""
    text = host_plan_text(plan["parts"], plan["available_bytes"], plan["available_from"] or "")
    return [f"  host memory: {text}"] if text else []


def describe(engine, url: str, started_s: float | None = None) -> str:
    """The startup banner: what was measured and chosen; its last line is "ready on URL"."""
    d = engine.describe()
    b, g = engine.cache.budget, engine.cache.geometry
    c, st = engine.cache.layout.unit_costs(), d["storage"]
    return "\n".join([
        f"ft serve: {d['model']} on {d['device']} ({d['dtype']}), context {engine.context_limit} tokens"
        + _rope_text(engine.model_config),
        f"  budget: card {format_bytes(b.card_bytes)}, weights {format_bytes(d['resident_weight_bytes'])}, "
        f"activation reserve {format_bytes(b.reserve_bytes)}, headroom {format_bytes(b.headroom_bytes)} "
        f"({_headroom_rule(engine.config.memory_ratio, b)}) -> cache budget {format_bytes(b.budget_bytes)}",
        *_device_lines(engine),
        *([f"  host: {host_tables_text(d['host_tables'], d['host_table_bytes'])} in host memory (rows gathered "
           "per step; outside the cache budget, not traded by the ladder)"] if d.get("host_table_bytes") else []),
        *_host_memory_lines(d["host_plan"]),
        *([f"  disk: {', '.join(f'{what} {format_bytes(n)}' for what, n in d['disk_tables'].items())} read from the "
           "checkpoint's files through the page cache (rows read by the host per step: a decode step waits for "
           "the one before it to read its rows; --ngram-table)"] if d.get("disk_tables") else []),
        f"  unit costs: expert slot {format_bytes(c.expert_slot)}, kv page {format_bytes(c.kv_page)} "
        f"({c.page_size} tokens), mamba slot {format_bytes(c.mamba_slot)}",
        f"  geometry: moe {g.moe_slots}/{engine.cache.total_experts} slots ({engine.config.moe_backend}), "
        f"kv {g.kv_tokens} tokens ({engine.pools.kv.dtype_name}), mamba {g.mamba_slots} "
        f"slots = {format_bytes(engine.cache.allocated_bytes)}",
        *_loan_lines(engine),
        *_mamba_demand_lines(engine, c.mamba_slot),
        *_prefix_lines(engine, c.mamba_slot),
        f"  storage: {st['backend']} (allocations rounded to {format_bytes(st['granularity_bytes'])}"
        + ("; a resize copies, so it holds old and new: the reachable ranges count that)" if st["reallocates"] else ")"),
        *(f"  kernels: {line}" for line in engine.kernel_fallbacks),  # shapes that take a reference path
        *_decode_lines(engine),
        _prefill_line(engine),
        *_ladder_lines(engine),
        f"  ready on {url}" + (f" (started in {started_s:.1f} s)" if started_s is not None else ""),
    ])


def _rope_text(cfg) -> str:
    """The banner's note on a scaled RoPE (what a config or --model-overrides set): empty for plain RoPE."""
    if cfg.rope_type == "default":
        return ""
    scaling = dict(cfg.rope_scaling)
    original = scaling.get("original_max_position_embeddings")
    return (f" (RoPE {cfg.rope_type}, factor {scaling.get('factor', 1):g}"
            + (f" over {int(original):,} tokens" if original else "") + ")")


def _headroom_rule(memory_ratio: float | None, budget) -> str:
    """How the banner's headroom was chosen (`ft.memory.budget.headroom_for`) from the free memory."""
    from ft.memory.budget import HEADROOM_CAP, HEADROOM_SHARE

    free = format_bytes(budget.free_bytes)
    if memory_ratio is not None:
        return f"the {1 - memory_ratio:.0%} of the {free} free that --memory-ratio {memory_ratio:g} leaves"
    if budget.headroom_bytes == HEADROOM_CAP:
        return f"at most {format_bytes(HEADROOM_CAP)} with offloaded experts; --memory-ratio sets a share"
    return f"{HEADROOM_SHARE:.0%} of the {free} free; --memory-ratio sets another share"


def _device_lines(engine) -> list[str]:
    """On a CUDA device, the banner's line on the card's use by the driver's count when ready (after the
    warm-up, which ran the largest steps): what of the card the process never took, beside the headroom."""
    d = engine.device_memory.read(fresh=True)
    if d is None:
        return []
    return [f"  device: {format_bytes(d.used_bytes)} of the {format_bytes(d.card_bytes)} card in use by the driver's "
            f"count (the caching allocator's peak {format_bytes(d.allocator_peak_bytes)}); "
            f"{format_bytes(d.untouched_bytes)} never taken (/metrics ft_device_memory_*)"]


def _loan_lines(engine) -> list[str]:
    """With the prefill reserve on loan (the default offloaded on one GPU), the banner's line on it (its bytes,
    whether it is out now, the flag that turns it off)."""
    cache = engine.cache
    if not cache.loan_bytes:
        return []
    now = "lent now" if cache.lent else "not lent now"
    hold = engine.loan.hold_s
    again = f"{hold:g} s after the last" if hold else "at the first step after the last"
    return [f"  prefill reserve: {format_bytes(cache.loan_bytes)} of it lent to expert slots while steps need at most "
            f"{engine.loan_keep_tokens} tokens ({now}); a longer step recalls what it needs first, lent again "
            f"{again} (--loan-hold-s; --no-lend-prefill-reserve: never lent)"]


def _mamba_demand_lines(engine, state_bytes: int) -> list[str]:
    """With --mamba-on-demand, the banner's line on the linear-attention pool's trade with the expert slots."""
    if engine.mamba_demand is None:
        return []
    return [f"  linear-attention slots on demand: {engine.cache.geometry.mamba_slots} now, grown for waiting requests "
            f"up to {engine.scheduler.max_running} ({format_bytes(state_bytes)} each, taken from expert slots) and "
            f"given back after {engine.mamba_demand.idle_s:.0f} s unused (--mamba-on-demand)"]


def _prefix_lines(engine, state_bytes: int) -> list[str]:
    """With the prefix cache's linear-attention states in host memory, the banner's line that says so."""
    n = engine.prefix_cache.host_entries if engine.prefix_cache.enabled else 0
    if not n:
        return []
    return [f"  prefix cache: up to {n} entries keep their linear-attention state ({format_bytes(state_bytes)} "
            "each) in host memory, copied to a running slot on a hit (--prefix-states-on-host)"]


def _decode_lines(engine) -> list[str]:
    """Offloaded, the decode's line of the banner: how a step gets the experts the cache lacks and which
    residents make room (the policy --expert-policy auto chose)."""
    cache = engine.pools.experts
    if engine.config.moe_backend != "offload" or cache is None:
        return []
    rt = cache.read_through
    policy = f"victims by {cache.policy} (--expert-policy {engine.config.expert_policy})"
    if rt is None:
        return [f"  decode: a layer's missing experts load into the cache before it runs; {policy}"]
    mapped = "; a victim stays a hit until a miss claims its slot" if rt.mapped_victims else ""
    return [f"  decode: misses read from host memory inside the step and cached as they land (read-through); "
            f"{policy}{mapped}"]


def _prefill_line(engine) -> str:
    """The prefill's line of the banner: the chunk size and, offloaded, how a chunk gets its experts."""
    line = f"  prefill: chunks of {engine.config.max_prefill_length} tokens (--max-prefill-length)"
    if engine.config.moe_backend != "offload":
        return line
    stream = engine.pools.experts.prefill_stream if engine.pools.experts is not None else None
    if stream is None:
        return line + "; a chunk's experts load into the cache (--prefill-stream-experts 0)"
    return (line + f"; a chunk of more than {stream.min_tokens - 1} tokens streams the experts the cache lacks "
            f"through {stream.pages * stream.page_experts} staging slots ({format_bytes(stream.nbytes)}"
            f"{'' if stream.pages > 1 else '; one page, no overlap: --disable-moe-prefill-overlap'}), "
            "evicting nothing decode uses")


def _ladder_lines(engine) -> list[str]:
    """The ladder's line of the banner: off, or its step and rungs (numbered from 1, as `ft ctl`
    and `ft top` number them) with the current one in brackets."""
    lad = engine.ladder
    if lad is None:
        return ["  ladder: off (--enable-kv-ladder trades expert slots for KV when a request needs the context)"]
    cur = lad.current(engine.cache.geometry.kv_tokens)
    rungs = " ".join(f"[{r}]" if i == cur else str(r) for i, r in enumerate(lad.rungs))
    return [f"  ladder: auto {'on' if lad.auto else 'off'}, step {lad.opts.step} tokens, {len(lad.rungs)} rungs "
            f"(kv tokens, 1..{len(lad.rungs)}): {rungs}"]


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGINT/SIGTERM end it with exit code 0 after the drain instead of
        re-raising the signal (which would make the process die by it)."""

        on_exit = None  # called once, on the first SIGINT/SIGTERM (the engine loop's drain)

        def handle_exit(self, sig, frame):
            if self.on_exit is not None:
                fn, self.on_exit = self.on_exit, None
                fn()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {}
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda s, f: self.handle_exit(s, f))
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def run(args: argparse.Namespace) -> int:
    """Check, bind, then serve (see the module docstring). User errors raise FreeTokenError before
    anything is bound (the command line prints them as one line)."""
    from ft.errors import ConfigError
    from ft.preflight import bind_port, check_model
    from ft.server import logs

    t0 = time.monotonic()
    if args.log_stats_interval < 0:
        raise ConfigError(f"--log-stats-interval must be >= 0 (0: no stats lines), got {args.log_stats_interval:g}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    config = engine_config_from_args(args)
    check_model(config)
    logs.configure(args.log_level, args.log_format, args.access_log_admin)  # process-wide: after the checks
    args.api_key = secret(args.api_key, args.api_key_file, "FT_API_KEY", "--api-key")
    args.admin_token = secret(args.admin_token, args.admin_token_file, "FT_ADMIN_TOKEN", "--admin-token")
    sock = bind_port(args.host, args.port)
    try:
        return _serve(args, config, sock, t0)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, config, sock, t0: float) -> int:
    import uvicorn

    from ft.preflight import build_engine
    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop

    _Server = _server_class()
    if not _is_loopback(args.host) and not (args.api_key and args.admin_token):
        log.warning("ft serve binds %s without --api-key and --admin-token: anyone who reaches this port can "
                    "generate and resize the caches. Set both tokens.", args.host)
    name = args.served_model_name or (
        "ft-demo" if config.model in (None, "", "demo") else os.path.basename(os.path.normpath(config.model)))

    def say(line: str) -> None:  # a console line (plain in text logs), as a startup phase begins
        log.info("ft serve: %s", line, extra={"plain": True})

    # phase lines unless --no-progress; the weights' bar only where config.progress says (a terminal)
    phase = say if args.progress is not False else None

    def build():
        engine = build_engine(config, phase)
        if args.warmup or (args.warmup is None and engine.device.type == "cuda"):
            from ft.engine.core.warmup import warm_up

            say(warm_up(engine, phase).line())
        engine.slow_steps.resume()  # from here on a slow step is a user's: logged with what it paid for
        if args.gc_freeze:
            from ft.server.gc_freeze import freeze_startup_heap

            log.debug("ft serve: %d objects frozen out of the garbage collector's reach", freeze_startup_heap())
        return engine

    loop = EngineLoop(build, stats_interval_s=args.log_stats_interval)
    state = ServerState(loop, name, args.api_key, args.admin_token, args.max_body_bytes, args.drain_timeout,
                        args.body_timeout, args.allow_client_chat_template)
    app = create_app(state)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"

    def announce():
        # NOTE: uvicorn listens once its startup (which starts the engine thread) is done; "ready"
        # waits for both, so that /health answers 200 to whoever reads the line
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.should_exit:
            return
        if not loop.ready.is_set():
            say(f"listening on {url}; /health answers 503 until the engine is ready")
        loop.ready.wait()
        if loop.engine is not None:
            log.info("%s", describe(loop.engine, url, time.monotonic() - t0), extra={"plain": True})
        else:
            log.error("ft serve: the engine failed to start: %s", loop.error, extra={"plain": True})
            server.should_exit = True

    from ft.server.http_protocol import JsonErrorH11Protocol

    server = _Server(uvicorn.Config(
        app, log_level=args.log_level, log_config=None,  # logging: ft.server.logs.configure (run)
        http=JsonErrorH11Protocol,  # (h11, with the API's error shape for requests it cannot parse)
        # NOTE: the engine loop aborts what still runs at the drain deadline, each response ending
        # properly; uvicorn's own cut (which would leave streams without [DONE]) comes only after
        timeout_graceful_shutdown=int(args.drain_timeout) + 10,
    ))
    server.on_exit = lambda: loop.begin_drain(args.drain_timeout)
    loop.on_failure = lambda: setattr(server, "should_exit", True)  # the device is lost: exit non-zero
    threading.Thread(target=announce, name="ft-announce", daemon=True).start()
    server.run(sockets=[sock])  # the socket bound by run(): the port was checked before the engine loaded
    return 1 if loop.error is not None else 0
