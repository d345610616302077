"""`ft ctl`: look at and resize a running server's caches from scripts.

    ft ctl cache                               the pools, their bytes and reachable ranges
    ft ctl cache --moe 1024 --kv 65536 --wait 300
    ft ctl cache --kv 131072 --dry-run         the plan: steps, peak, fits or not
    ft ctl history                             past rebuilds, newest first
    ft ctl requests                            running and waiting requests
    ft ctl ladder --auto on | --up | --down | --rung N

Exit codes: 0 done, 1 refused / rolled back / not finished in time, 2 usage error, 3 server
unreachable. A failure prints one line to stderr that says what to do.

Imports stay light (argparse here; httpx, pydantic and ft.schemas once a command runs): this
module must never pull in torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ft.argparser import Parser, RawHelpFormatter
from ft.units import seconds_arg

# Tests (or embedders) may set an httpx transport here, e.g. httpx.MockTransport(handler).
TRANSPORT: Any = None

EPILOG = """\
server: --url or FT_URL (default http://127.0.0.1:30000); admin token: --token or FT_ADMIN_TOKEN.
exit codes: 0 done, 1 refused / rolled back / not finished in time, 2 usage error,
3 server unreachable."""


def _count(text: str) -> int:
    try:
        n = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


_wait = seconds_arg(0, 3600)
_timeout = seconds_arg(0, above=True)


def _rung_number(text: str) -> int:
    """A rung as users count it (1 = the first) -> the admin API's 0-based index."""
    n = _count(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"rungs are counted from 1, got {n}")
    return n - 1


def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    """--url/--token/--timeout, accepted before and after the sub-command: the copies after it
    default to SUPPRESS so they do not overwrite the values given before it."""
    d = {"default": argparse.SUPPRESS} if suppress else {"default": None}
    p.add_argument("--url", metavar="URL", help="server address (default: FT_URL or http://127.0.0.1:30000)", **d)
    p.add_argument("--token", metavar="TOKEN", help="admin token (default: FT_ADMIN_TOKEN)", **d)
    p.add_argument("--timeout", metavar="S", type=_timeout,
                   help="seconds to wait for a plain answer (default 10; a resize waits its --wait longer)", **d)


def add_parser(sub) -> None:
    """Register `ctl` on the top-level `ft` subparsers."""
    fmt = RawHelpFormatter  # the descriptions' line breaks kept; defaults shown
    p = sub.add_parser("ctl", help="inspect and resize a running server's caches",
                       description="Inspect and resize a running `ft serve`'s caches through its admin API.",
                       epilog=EPILOG, formatter_class=fmt)
    _common(p, suppress=False)
    p.set_defaults(func=run, ctl_func=None, ctl_usage=p.format_usage)
    cmds = p.add_subparsers(dest="ctl_command", metavar="{cache,history,requests,ladder}")

    c = cmds.add_parser(
        "cache", help="show the cache pools, or resize them", epilog=EPILOG, formatter_class=fmt,
        description="Without targets: show the pools (size, bytes, reachable range).\n"
                    "With targets: rebuild the caches at those sizes (pools not named keep\n"
                    "their size), then show the new state.")
    c.add_argument("--moe", type=_count, metavar="SLOTS", help="MoE expert cache size in slots (default: unchanged)")
    c.add_argument("--kv", type=_count, metavar="TOKENS", help="KV cache size in tokens (default: unchanged)")
    c.add_argument("--mamba", type=_count, metavar="SLOTS", help="mamba state cache size in slots (default: unchanged)")
    c.add_argument("--wait", type=_wait, metavar="S",
                   help="seconds the server waits for running requests and the rebuild (0..3600) "
                        "(default: none: refused at once if running requests hold what it needs)")
    c.add_argument("--dry-run", action="store_true",
                   help="only plan: print the steps and the peak against the budget (exit 1 if it does not fit)")
    c.add_argument("--json", action="store_true", help="print the server's JSON")
    _common(c, suppress=True)
    c.set_defaults(ctl_func=_cmd_cache)

    h = cmds.add_parser("history", help="past rebuilds, newest first", epilog=EPILOG, formatter_class=fmt,
                        description="Past cache rebuilds, newest first: trigger, sizes, status, time, peak, errors.")
    h.add_argument("--json", action="store_true", help="print the server's JSON")
    _common(h, suppress=True)
    h.set_defaults(ctl_func=_cmd_history)

    rq = cmds.add_parser("requests", help="running and waiting requests", epilog=EPILOG, formatter_class=fmt,
                         description="The running requests (batch order), then the waiting ones (queue order):\n"
                                     "id, state, prompt and generated tokens, KV pages held, age.")
    rq.add_argument("--limit", type=int, default=200, help="list at most this many requests")
    rq.add_argument("--json", action="store_true", help="print the server's JSON")
    _common(rq, suppress=True)
    rq.set_defaults(ctl_func=_cmd_requests)

    lad = cmds.add_parser(
        "ladder", help="show or steer the KV/MoE ladder", epilog=EPILOG, formatter_class=fmt,
        description="Without options: show the caches and the ladder. --auto turns automatic\n"
                    "laddering on or off; --up / --down / --rung move the KV cache to another\n"
                    "rung now (trading MoE slots for KV tokens or back).")
    lad.add_argument("--auto", choices=("on", "off"), help="automatic laddering on or off (default: unchanged)")
    move = lad.add_mutually_exclusive_group()
    move.add_argument("--up", action="store_const", const="up", dest="rung", help="one rung up (more KV)")
    move.add_argument("--down", action="store_const", const="down", dest="rung", help="one rung down (more MoE)")
    move.add_argument("--rung", type=_rung_number, metavar="N", dest="rung",
                      help="go to rung N, counted from 1 (the first rung `ft ctl cache` lists), as `ft top` "
                           "and the `ft serve` banner count them (default: stay)")
    lad.add_argument("--json", action="store_true", help="print the server's JSON")
    _common(lad, suppress=True)
    lad.set_defaults(ctl_func=_cmd_ladder)


def run(args: argparse.Namespace) -> int:
    """Entry from `ft ctl ...` (ft/cli.py)."""
    return _run(args, TRANSPORT)


def main(argv: list[str] | None = None, transport: Any = None) -> int:
    """`ft ctl` on its own: argv is what follows `ctl` (a leading 'ctl' is accepted too).
    Returns the exit code instead of raising SystemExit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "ctl":
        argv = ["ctl", *argv]
    parser = Parser(prog="ft")
    add_parser(parser.add_subparsers(dest="command"))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return _run(args, transport if transport is not None else TRANSPORT)


def _run(args: argparse.Namespace, transport: Any) -> int:
    if args.ctl_func is None:
        sys.stderr.write(args.ctl_usage())
        print("ft ctl: choose a command: cache, history, requests or ladder (see `ft ctl --help`)", file=sys.stderr)
        return 2
    from ft.ctl.client import AdminClient, CtlError, default_token, default_url

    token = args.token if args.token is not None else default_token()
    try:
        with AdminClient(args.url or default_url(), token or None,
                         timeout=args.timeout or 10.0, transport=transport) as client:
            return args.ctl_func(client, args)
    except CtlError as e:
        print(e.message if e.seed_line else f"ft ctl: {e.message}", file=sys.stderr)
        for line in e.detail:
            print(line, file=sys.stderr)
        return e.exit_code


def _print(client, as_json: bool, render) -> None:
    """The server's JSON as it came (pretty), or `render()`'s text."""
    from ft.ctl.client import dumps

    print(dumps(client.last_json) if as_json else render())


def _cmd_cache(client, args) -> int:
    from ft.ctl import format as fmt
    from ft.ctl.client import CtlError

    targets = {k: getattr(args, k) for k in ("moe", "kv", "mamba") if getattr(args, k) is not None}
    if not targets:
        for flag, given in (("--dry-run", args.dry_run), ("--wait", args.wait is not None)):
            if given:
                raise CtlError(f"{flag} needs a target: add --moe, --kv or --mamba", 2)
        state = client.cache()
        _print(client, args.json, lambda: fmt.format_cache(state))
        return 0
    if args.dry_run and args.wait is not None:
        raise CtlError("--wait has no effect with --dry-run (nothing is rebuilt); drop one of them", 2)
    result = client.resize(**targets, wait_s=args.wait, dry_run=args.dry_run)
    if args.dry_run:
        _print(client, args.json, lambda: fmt.format_plan(result))
        if not result.fits:
            from ft.ctl.client import resize_hint

            reason = " ".join(result.reason.split()) if result.reason else "its peak exceeds the rebuild budget"
            # the printed plan already ends with the reason: the error line then only adds what to do
            said = "" if not args.json and result.reason else f": {reason}"
            print(f"ft ctl: the plan does not fit{said}; {resize_hint(reason)}", file=sys.stderr)
            return 1
        return 0
    _print(client, args.json, lambda: "\n".join([fmt.format_cache(result), *fmt.format_notes(result.notes)]))
    return 0


def _cmd_history(client, args) -> int:
    from ft.ctl import format as fmt

    hist = client.history()
    _print(client, args.json, lambda: fmt.format_history(hist))
    return 0


def _cmd_requests(client, args) -> int:
    from ft.ctl import format as fmt

    if args.limit < 1:
        from ft.ctl.client import EXIT_USAGE, CtlError

        raise CtlError(f"--limit must be at least 1, got {args.limit}", EXIT_USAGE)
    listing = client.requests(limit=args.limit)
    _print(client, args.json, lambda: fmt.format_requests(listing))
    return 0


def _cmd_ladder(client, args) -> int:
    from ft.ctl import format as fmt

    if args.auto is None and args.rung is None:
        state = client.cache()
    else:
        state = client.ladder(auto=None if args.auto is None else args.auto == "on", rung=args.rung)
    _print(client, args.json, lambda: fmt.format_cache(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
