"""`ft quantize SRC DST`: the command line of the NVFP4 checkpoint converter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ft.argparser import Parser
from ft.tools.quantize import (  # noqa: F401
    DEFAULT_EXCLUDE,
    QuantizeError,
)
from ft.tools.quantize_checkpoint import quantize_checkpoint


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, help="Hugging Face checkpoint directory (bf16/fp16/fp32 safetensors)")
    parser.add_argument("dst", type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="PATTERN",
        help="keep modules matching this fnmatch pattern dense (repeatable; adds to the defaults: "
        + " ".join(DEFAULT_EXCLUDE) + ")",
    )
    parser.add_argument("--no-default-exclude", action="store_true", help="do not apply the default exclude patterns")
    parser.add_argument(
        "--device", default="auto", help="compute device: auto (CUDA when present), cpu, cuda, cuda:1, ..."
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


_DESCRIPTION = (
    "Convert a Hugging Face safetensors checkpoint to an NVFP4 checkpoint in NVIDIA ModelOpt's "
    "format (weight, weight_scale, weight_scale_2, input_scale; hf_quant_config.json)."
)


def _run(args: argparse.Namespace) -> int:
    exclude = ([] if args.no_default_exclude else list(DEFAULT_EXCLUDE)) + list(args.exclude)
    try:
        stats = quantize_checkpoint(
            args.src, args.dst, exclude=tuple(exclude), progress=not args.quiet, device=args.device
        )
    except (QuantizeError, OSError) as e:
        print(f"ft quantize: error: {e}", file=sys.stderr)
        return 1
    print(f"ft quantize: {args.dst}: {stats.summary()}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``quantize`` on an argparse subparsers object; ``args.func(args)`` runs it."""
    parser = subparsers.add_parser(
        "quantize",
        help="convert a Hugging Face checkpoint to NVFP4 (ModelOpt format)",
        description=_DESCRIPTION,
    )
    _add_arguments(parser)
    parser.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``ft quantize SRC DST [--exclude PATTERN ...] [--no-default-exclude] [--device D] [--quiet]``.

    Returns the exit code: 0 on success, 1 on a conversion error (message on stderr), 2 on bad
    arguments.
    """
    parser = Parser(prog="ft quantize", description=_DESCRIPTION)  # no abbreviations, defaults in --help
    _add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on bad arguments
        return int(e.code or 0)
    return _run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
