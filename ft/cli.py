"""`ft`: the command line. A thin composition root: each subcommand lives in its own module,
imported only when it is the one chosen, so `ft ctl` and `ft --help` never load torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from ft.argparser import Parser

# name -> (module with add_parser(subparsers), one-line help)
COMMANDS = {
    "serve": ("ft.serve_cmd", "serve a model over an OpenAI-compatible HTTP API"),
    "ctl": ("ft.ctl.cli", "inspect and resize a running server's caches"),
    "top": ("ft.tui.cli", "live dashboard of pools, ladder and rebuilds"),
    "generate": ("ft.generate_cmd", "generate text for one prompt"),
    "quantize": ("ft.tools.quantize_cli", "convert a Hugging Face checkpoint to NVFP4 (ModelOpt format)"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The `ft` parser with `command`'s subparser complete (the others are names and help only)."""
    from ft import __version__

    # Parser: no abbreviations, defaults in every --help, a bad flag reported by its subcommand
    # (with "did you mean"); the subcommands' parsers inherit the class
    parser = Parser(prog="ft", description="FreeToken: serve large MoE models on small GPUs")
    parser.add_argument("--version", action="version", version=f"ft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from ft.errors import FreeTokenError

    try:
        return int(args.func(args) or 0)
    except FreeTokenError as e:  # a user error is one line, not a traceback
        print(f"ft {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
