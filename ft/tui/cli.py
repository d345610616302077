"""`ft top [--url URL] [--token T | --admin-token T] [--refresh S]`: the live dashboard (Textual, no torch)."""

from __future__ import annotations

import argparse
import sys

from ft.units import seconds_arg

_refresh = seconds_arg(0.1, 60)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "top", help="live dashboard of pools, ladder and rebuilds",
        description="A live dashboard of a running server: pools and reachable ranges, the KV ladder, "
                    "live rates, running and waiting requests, and rebuild history; + / - move a rung, a toggles "
                    "auto, r resizes.",
        epilog="server: --url or FT_URL (default http://127.0.0.1:30000); admin token: --admin-token (or --token) "
               "or FT_ADMIN_TOKEN.")
    p.add_argument("--url", default=None, help="the server (default $FT_URL or http://127.0.0.1:30000)")
    p.add_argument("--token", "--admin-token", dest="token", default=None,
                   help="the admin token, as `ft serve --admin-token` has it (default $FT_ADMIN_TOKEN)")
    p.add_argument("--refresh", type=_refresh, default=1.0, metavar="S", help="seconds between updates (default 1)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ft.ctl.client import CtlError
    from ft.tui.app import make_app

    try:
        app = make_app(args.url, args.token, args.refresh)
    except CtlError as e:
        print(f"ft top: {e.message}", file=sys.stderr)
        return e.exit_code
    app.run()
    return 0
