"""The argparse flavour every `ft` command line uses (stdlib only: `ft --help` stays instant).

`Parser` differs from `argparse.ArgumentParser` in four ways:

* no abbreviations (`allow_abbrev=False`): `--mem 1` is an error, not `--memory-ratio 1`;
* every `--help` shows each option's default (`HelpFormatter`);
* an unknown flag after a subcommand is reported by that subcommand's parser, with its usage,
  not the top-level one (`argparse` hands such leftovers up to the top parser);
* an unknown flag or a bad choice ends with "did you mean ...?" when a close name exists.

Subparsers made from a `Parser` are `Parser`s too (argparse's `parser_class` default).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn


def _default_text(action: argparse.Action) -> str:
    """How a default reads in --help: on/off for switches, none for None or an empty list."""
    d = action.default
    if isinstance(d, bool) and action.nargs == 0:
        return "on" if d else "off"
    if d is None or d == []:
        return "none"
    return "%(default)s"


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option's help unless the help already states its default
    (it says "(default" or uses %(default)s) or there is none (a required option, a switch that
    stores a constant)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is argparse.SUPPRESS or "(default" in text or "%(default)" in text or action.required:
            return text
        if action.nargs == 0 and action.default is None:  # a store_const switch (--up): nothing to show
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text  # a required positional has no default
        return f"{text} (default: {_default_text(action)})"


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`HelpFormatter` that keeps the description's and epilog's line breaks."""


class _SubParsers(argparse._SubParsersAction):
    """Subcommands whose leftovers are the subcommand's error: its usage, its suggestions."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        extras = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            chosen = self._name_parser_map[values[0]]
            if isinstance(chosen, Parser):
                chosen.unrecognized(extras)
            vars(namespace)[argparse._UNRECOGNIZED_ARGS_ATTR] = extras  # a foreign parser: argparse's way


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with the behaviour described in the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsers)

    def parse_args(self, args=None, namespace=None):
        """argparse's, with leftovers reported by `unrecognized` (exit 2)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return ns

    def unrecognized(self, extras: list[str]) -> NoReturn:
        """Exit 2 with this parser's usage: the leftover arguments and the closest known flags."""
        hints = self.suggest([a for a in extras if a.startswith("-")])
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {hints}?" if hints else ""))

    def suggest(self, flags: list[str]) -> str:
        """"--x" or "--x or --y": the known option strings closest to the unknown `flags`: those
        they abbreviate, else similar spellings (difflib); at most one per option, three in all."""
        known = self._option_string_actions
        picked: dict[int, str] = {}  # id(action) -> its spelling closest to what was typed
        for flag in flags:
            name = flag.split("=", 1)[0]
            if name in known:
                continue
            prefixed = [s for s in known if s.startswith(name)] if len(name.lstrip("-")) >= 2 else []
            # what it abbreviates (the old `--mem` for `--memory-ratio`) beats a mere resemblance
            close = [] if prefixed else difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
            by_likeness = sorted(prefixed, key=lambda s, n=name: difflib.SequenceMatcher(None, n, s).ratio(),
                                 reverse=True)
            for s in by_likeness + close:
                a = id(known[s])
                if a not in picked and len(picked) < 3:
                    picked[a] = s
        return " or ".join(picked.values())

    def error(self, message: str) -> NoReturn:
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]}?"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")
