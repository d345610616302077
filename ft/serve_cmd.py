"""`ft serve`: the daemon. HTTP comes up at once (/health answers 503 while the engine loads);
the engine thread then prints what it measured and the server starts serving."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import sys
import threading

from ft.engine_args import add_engine_args, engine_config_from_args
from ft.units import format_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API with admin routes.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: ft-demo or the folder name)")
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1 routes (visible in ps: prefer "
                   "$FT_API_KEY or --api-key-file)")
    p.add_argument("--api-key-file", default=None, help="read the /v1 bearer key from this file (first line)")
    p.add_argument("--admin-token", default=None, help="require this bearer token on /admin routes (visible in ps: "
                   "prefer $FT_ADMIN_TOKEN or --admin-token-file)")
    p.add_argument("--admin-token-file", default=None, help="read the /admin bearer token from this file (first line)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body accepted")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get to finish on shutdown")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may stall before the request is refused (408)")
    p.add_argument("--allow-client-chat-template", action="store_true",
                   help="let requests bring their own chat template (chat_template_kwargs.chat_template; sandboxed "
                        "Jinja, but it runs their code)")
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
        print(f"WARNING: {name} on the command line is visible to every local user (ps); "
              f"use ${env} or {name}-file", file=sys.stderr)
        return flag
    return os.environ.get(env) or None


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def describe(engine, url: str) -> str:
    d = engine.describe()
    b, g = engine.cache.budget, engine.cache.geometry
    c, st = engine.cache.layout.unit_costs(), d["storage"]
    return "\n".join([
        f"ft serve: {d['model']} on {d['device']} ({d['dtype']}), context {engine.context_limit} tokens",
        f"  budget: card {format_bytes(b.card_bytes)}, weights {format_bytes(d['resident_weight_bytes'])}, "
        f"activation reserve {format_bytes(b.reserve_bytes)} -> cache budget {format_bytes(b.budget_bytes)}",
        f"  unit costs: expert slot {format_bytes(c.expert_slot)}, kv page {format_bytes(c.kv_page)} "
        f"({c.page_size} tokens), mamba slot {format_bytes(c.mamba_slot)}",
        f"  geometry: moe {g.moe_slots}/{engine.cache.total_experts} slots ({engine.config.moe_backend}), "
        f"kv {g.kv_tokens} tokens ({str(engine.pools.kv.kv.dtype).removeprefix('torch.')}), mamba {g.mamba_slots} "
        f"slots = {format_bytes(engine.cache.allocated_bytes)}",
        f"  storage: {st['backend']} (allocations rounded to {format_bytes(st['granularity_bytes'])}"
        + ("; a resize copies, so it holds old and new: the reachable ranges count that)" if st["reallocates"] else ")"),
        *_ladder_lines(engine),
        f"  serving on {url}",
    ])


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
    import uvicorn

    _Server = _server_class()

    from ft.engine.engine import Engine
    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    args.api_key = secret(args.api_key, args.api_key_file, "FT_API_KEY", "--api-key")
    args.admin_token = secret(args.admin_token, args.admin_token_file, "FT_ADMIN_TOKEN", "--admin-token")
    config = engine_config_from_args(args)
    if not _is_loopback(args.host) and not (args.api_key and args.admin_token):
        print(f"WARNING: ft serve binds {args.host} without --api-key and --admin-token: anyone who reaches "
              "this port can generate and resize the caches. Set both tokens.", file=sys.stderr)
    name = args.served_model_name or ("ft-demo" if config.model in (None, "", "demo") else os.path.basename(os.path.normpath(config.model)))
    loop = EngineLoop(lambda: Engine(config))
    state = ServerState(loop, name, args.api_key, args.admin_token, args.max_body_bytes, args.drain_timeout,
                        args.body_timeout, args.allow_client_chat_template)
    app = create_app(state)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"

    def announce():
        loop.ready.wait()
        if loop.engine is not None:
            print(describe(loop.engine, url), file=sys.stderr, flush=True)
        else:
            print(f"ft serve: the engine failed to start: {loop.error}", file=sys.stderr, flush=True)
            server.should_exit = True

    server = _Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        # NOTE: the engine loop aborts what still runs at the drain deadline, each response ending
        # properly; uvicorn's own cut (which would leave streams without [DONE]) comes only after
        timeout_graceful_shutdown=int(args.drain_timeout) + 10,
    ))
    server.on_exit = lambda: loop.begin_drain(args.drain_timeout)
    threading.Thread(target=announce, daemon=True).start()
    server.run()
    return 1 if loop.error is not None else 0
