"""Garbage-collector pauses inside `ft serve` under load. Not a test.

    python bench/gc_pauses.py --out pauses.json -- --port 30000 [--no-gc-freeze] [other ft serve flags]

Runs `ft serve` with the given flags in this process, with a `gc.callbacks` hook timing every
collection, and on exit (Ctrl-C / SIGINT, as `ft serve` stops) writes each generation's count,
total, p50 / p99 / max pause in ms and the number of tracked objects at the end to `--out`, and
prints a table. Drive it with `bench/serve.py --url ...` from another process; compare a run with
`--no-gc-freeze` against one without. Pauses count only after the engine is ready (the ready line).
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import time

from ft.cli import main as ft_main


class PauseLog:
    """(generation, seconds) of every collection from `arm()` on."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0
        self.armed = False

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.armed:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def summary(self) -> dict:
        out = {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count()}
        for g in (0, 1, 2):
            ms = sorted(s * 1e3 for gen, s in self.pauses if gen == g)
            out[f"gen{g}"] = {"count": len(ms), "total_ms": round(sum(ms), 2),
                              "p50_ms": round(ms[len(ms) // 2], 3) if ms else None,
                              "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3) if ms else None,
                              "max_ms": round(ms[-1], 3) if ms else None}
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the summary")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then ft serve's flags")
    args = ap.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    pauses = PauseLog()
    gc.callbacks.append(pauses)

    import logging

    class ArmAtReady(logging.Handler):  # the banner's last line says ready: count from there
        def emit(self, record: logging.LogRecord) -> None:
            if "ready on http" in record.getMessage():
                pauses.armed = True

    logging.getLogger().addHandler(ArmAtReady())
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    rc = ft_main(["serve", *serve_args])
    s = pauses.summary()
    with open(args.out, "w") as f:
        json.dump(s, f, indent=1)
    print("| generation | collections | total ms | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for g in (0, 1, 2):
        r = s[f"gen{g}"]
        print(f"| {g} | {r['count']} | {r['total_ms']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} |")
    print(f"tracked objects at exit: {s['tracked_objects']:,}; frozen: {s['frozen_objects']:,}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
