"""The open issues' target rows in one run on the device, each measured by the benchmark that defines it, and a
table last: issue, measure, target, measured, met.

    python3 bench/targets.py [--rows NAME[,NAME...]] [--tokenizer DIR] [--out DIR] [--tail N] [--dry-run] [--list]

On the lent device the tokenizer must travel with the tree (`../shared` does not): copy
`../shared/reference/qwen3-tokenizer` into an ignored folder that the call carries and pass it, e.g.
`python3 bench/targets.py --tokenizer scratch/qwen3-tokenizer --out $OUT/targets` (the logs then come back). All
rows take ~15 minutes of an H200: split them over calls with `--rows` (the serve rows share one server start,
~80 s).

Rows (`ROWS`, in run order; `--rows` picks some, `--list` names them):

- issue 40 (`ft serve` at the engine's speed): one `ft serve` of the synthetic Qwen3-Next-80B, resident, default
  flags and `--max-running-requests 64`, the tokenizer given (`--tokenizer`, the real Qwen3 tokenizer: random ids
  then detokenize into real text), started once for every serve row; each row is a `bench/serve.py --url` run
  against it (its own warm-up request first), the rows in the issue's table;
- issue 39: the offloaded decode of the 80B on an emulated 32 GiB card, 64K rung, 4,096 tokens (`bench/ladder.py`);
- issue 38: Qwen3.8-Flash-Next resident at batch 1 and 8 (`bench/decode.py`), offloaded on a 32 GiB card at the 64K
  rung, and the ladder's gain on a 16 GiB card (64K rung against the fixed 256K), both by `bench/ladder.py`. Its
  config is `qwen3.8-flash-next-small-table.json`: the real n-gram table (95 GiB in bf16) beside the experts passes
  the lent machines' 125 GiB of host memory; the small table changes what the host holds, not the step.

Each benchmark runs as a process of its own (a user's fresh process), its output kept under `--out` and its figures
read from what it prints (`parse_*`, tested on CPU against captured output: tests/test_bench_targets.py). A row
whose benchmark fails says so in the table; the others still run. The issues name the H200; the table says which
card ran (a row on another card is a figure, not the target's verdict).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

EIGHTY_B = "bench/configs/qwen3-next-80b-a3b.json"
FLASH_NEXT = "bench/configs/qwen3.8-flash-next-small-table.json"
SERVE_ARGS = f"--model synthetic:{EIGHTY_B} --moe-backend resident --max-running-requests 64"


@dataclass(frozen=True)
class Row:
    """One target row: `command` (argv after `python3`, run from the repository root; for serve rows the
    `bench/serve.py` arguments after `--url URL`) and `judge`, which reads the parsed figures and returns
    (measured text, met)."""

    name: str
    issue: int
    measure: str
    target: str
    command: tuple[str, ...]
    parse: Callable[[str, Path], dict]
    judge: Callable[[dict], tuple[str, bool]]
    serve: bool = False


# --- parsers: a benchmark's printed output (and its --json file) -> figures ------------------------------------


def parse_serve(_: str, json_path: Path) -> dict:
    """`bench/serve.py --json`'s one level: output tok/s, TTFT / ITL p50 ms, errors."""
    level = json.loads(json_path.read_text())["levels"][0]
    return {"tok_s": level["output_throughput"], "ttft_p50_ms": level["ttft_ms"]["p50"],
            "itl_p50_ms": level["itl_ms"]["p50"], "errors": level["errors"], "completed": level["completed"]}


LADDER_LINE = re.compile(r"^(\S+) kv (\d+): (\{.*\})$", re.M)


def parse_ladder(text: str, _: Path) -> dict:
    """`bench/ladder.py`'s per-rung lines (`CARD kv TOKENS: {...}`) -> {(card, kv tokens): figures}; a refused
    rung prints none."""
    return {(card, int(kv)): ast.literal_eval(body) for card, kv, body in LADDER_LINE.findall(text)}


DECODE_ROW = re.compile(r"^\S.*?\s+(\d+)\s+([a-z][\w:.-]*)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s", re.M)


def parse_decode(text: str, _: Path) -> dict:
    """`bench/decode.py`'s table (model, context, mode, batch, tok/s, ms/step, ...) -> {batch: tok/s} of its
    rows (the last row of a batch where modes repeat)."""
    return {int(batch): float(tok_s) for _, _, batch, tok_s, _ in DECODE_ROW.findall(text)}


# --- judges ---------------------------------------------------------------------------------------------------


def _at_least(key: str, bound: float, fmt: str = "{:,.1f}") -> Callable[[dict], tuple[str, bool]]:
    def judge(f: dict) -> tuple[str, bool]:
        return fmt.format(f[key]) + (f" ({f['errors']} errors)" if f.get("errors") else ""), \
            f[key] >= bound and not f.get("errors")
    return judge


def _lambda_setting(f: dict) -> tuple[str, bool]:
    text = f"{f['tok_s']:,.1f} tok/s, TTFT p50 {f['ttft_p50_ms'] / 1e3:.2f} s, ITL p50 {f['itl_p50_ms']:.1f} ms"
    return text, f["tok_s"] >= 2000 and f["ttft_p50_ms"] <= 1500 and f["itl_p50_ms"] <= 20 and not f["errors"]


def _ladder_row(card: str, kv: int, tokens: int, bound: float) -> Callable[[dict], tuple[str, bool]]:
    def judge(f: dict) -> tuple[str, bool]:
        r = f[(card, kv)]
        return f"{r['tok_s'][tokens]:,.1f} tok/s ({r['hit_rate']:.1%} hits, serial floor " \
               f"{r['serial_floor_tok_s']:,.0f})", r["tok_s"][tokens] >= bound
    return judge


def _ladder_gain(f: dict) -> tuple[str, bool]:
    low, high = f[("16GiB", 65536)]["tok_s"][4096], f[("16GiB", 262144)]["tok_s"][4096]
    gain = low / high - 1
    return f"{gain:+.1%} ({low:,.1f} against {high:,.1f} tok/s)", gain >= 0.33


def _resident(f: dict) -> tuple[str, bool]:
    return f"{f[1]:,.1f} / {f[8]:,.1f}", f[1] >= 250 and f[8] >= 1000


def _serve(concurrency: int, prompts: int, input_len: int, output_len: int) -> tuple[str, ...]:
    return ("--concurrency", str(concurrency), "--num-prompts", str(prompts), "--warmup", "1",
            "--input-len", str(input_len), "--output-len", str(output_len))


ROWS = [
    Row("c32-1k", 40, "concurrency 32, 1K in / 256 out, output tok/s", ">= 1,700", _serve(32, 128, 1024, 256),
        parse_serve, _at_least("tok_s", 1700), serve=True),
    Row("c64-1k", 40, "concurrency 64, 1K in / 256 out, output tok/s", ">= 2,100", _serve(64, 128, 1024, 256),
        parse_serve, _at_least("tok_s", 2100), serve=True),
    Row("c10-1k1k", 40, "concurrency 10, 1K in / 1K out, output tok/s", ">= 1,500", _serve(10, 30, 1024, 1024),
        parse_serve, _at_least("tok_s", 1500), serve=True),
    Row("c32-8k", 40, "concurrency 32, 8K in / 1K out", ">= 2,000 tok/s, TTFT p50 <= 1.5 s, ITL p50 <= 20 ms",
        _serve(32, 64, 8192, 1024), parse_serve, _lambda_setting, serve=True),
    Row("offload-80b", 39, "offloaded decode, 32 GiB card, 64K rung, 4,096 tokens", ">= 250 tok/s",
        ("bench/ladder.py", "--cards", "32GiB", "--rungs", "65536", "--tokens", "1024,4096"),
        parse_ladder, _ladder_row("32GiB", 65536, 4096, 250)),
    Row("fn-resident", 38, "Flash-Next resident decode, batch 1 / 8, tok/s", ">= 250 / >= 1,000",
        ("bench/decode.py", "--config", FLASH_NEXT, "--batches", "1,8", "--tokens", "64", "--replay-span", "50",
         "--modes", "overlap", "--memory-ratio", "0.97"), parse_decode, _resident),
    Row("fn-offload", 38, "Flash-Next decode, 32 GiB card, 64K rung, 4,096 tokens", ">= 150 tok/s",
        ("bench/ladder.py", "--config", FLASH_NEXT, "--cards", "32GiB", "--rungs", "65536", "--tokens", "4096"),
        parse_ladder, _ladder_row("32GiB", 65536, 4096, 150)),
    Row("fn-ladder", 38, "Flash-Next ladder gain, 16 GiB card, 64K vs fixed 256K, 4,096 tokens", ">= +33%",
        ("bench/ladder.py", "--config", FLASH_NEXT, "--cards", "16GiB", "--rungs", "65536,262144", "--tokens", "4096"),
        parse_ladder, _ladder_gain),
]


def commands(rows: list[Row], url: str, out: Path) -> list[list[str]]:
    """Each row's argv (serve rows against `url`, their figures in OUT/NAME.json)."""
    return [[sys.executable, "bench/serve.py", "--url", url, *row.command, "--json", str(out / f"{row.name}.json")]
            if row.serve else [sys.executable, *row.command] for row in rows]


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        return "no torch"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS), help="rows to run, comma-separated (--list)")
    ap.add_argument("--list", action="store_true", help="name the rows and exit")
    ap.add_argument("--tail", type=int, default=0, metavar="N",
                    help="print the last N lines of each row's log after its figure (where the logs may not come back "
                         "from the machine that ran them)")
    ap.add_argument("--tokenizer", default="../shared/reference/qwen3-tokenizer",
                    help="the serve rows' --tokenizer (default: %(default)s)")
    ap.add_argument("--out", default=None, help="folder for each benchmark's output (default: a new temporary one)")
    ap.add_argument("--server-timeout", type=float, default=900.0, metavar="S",
                    help="seconds the serve rows' server may take to be healthy (default: %(default)g)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.name:12} issue {row.issue}: {row.measure} ({row.target})")
        return 0
    wanted = [n for n in args.rows.split(",") if n]
    unknown = [n for n in wanted if n not in {r.name for r in ROWS}]
    if unknown or not wanted:
        ap.error(f"--rows: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(r.name for r in ROWS)}")
    rows = [r for r in ROWS if r.name in wanted]
    out = Path(args.out or tempfile.mkdtemp(prefix="ft-targets-")).resolve()
    serve_args = f"{SERVE_ARGS} --tokenizer {args.tokenizer}"
    if args.dry_run:
        if any(r.serve for r in rows):
            print(f"{sys.executable} -m ft.cli serve {serve_args} --port PORT   (the serve rows' server)")
        for cmd in commands(rows, "http://127.0.0.1:PORT", out):
            print(shlex.join(cmd))
        return 0
    if any(r.serve for r in rows) and not Path(args.tokenizer).is_dir():
        ap.error(f"--tokenizer {args.tokenizer}: not a directory (the serve rows detokenize with it)")
    out.mkdir(parents=True, exist_ok=True)
    from bench.serve import BenchError, ServerProcess

    card = device_name()
    print(f"card: {card}; each benchmark's output in {out}", flush=True)
    results: list[tuple[Row, str, bool | None, float]] = []
    server, server_failed = None, False
    try:
        for row, cmd in zip(rows, commands(rows, "", out)):
            if row.serve:
                if server_failed:
                    continue
                if server is None:
                    server = ServerProcess(serve_args, str(out / "server.log"))
                    print(f"starting {shlex.join(server.cmd)}", flush=True)
                    try:
                        server.wait_healthy(args.server_timeout)
                    except BenchError as e:
                        print(f"bench/targets.py: {e}", file=sys.stderr)
                        server.stop(60.0)
                        server, server_failed = None, True
                        results += [(r, f"ft serve did not start (see {out / 'server.log'})", None, 0.0)
                                    for r in rows if r.serve]
                        continue
                cmd[cmd.index("--url") + 1] = server.url
            elif server is not None:  # the serve rows are done: their server's memory goes back first
                server.stop(60.0)
                server = None
            log = out / f"{row.name}.log"
            print(f"== {row.name}: {shlex.join(cmd)}", flush=True)
            t0 = time.monotonic()
            path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
            with log.open("w") as f:
                rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            took = time.monotonic() - t0
            try:
                measured, met = row.judge(row.parse(log.read_text(errors="replace"), out / f"{row.name}.json"))
                if rc:
                    measured += f" (exit {rc})"
            except (KeyError, ValueError, OSError, SyntaxError, IndexError, TypeError) as e:
                measured, met = f"no figures (exit {rc}; {type(e).__name__}: see {log})", None
            print(f"   {measured} in {took:.0f} s", flush=True)
            if args.tail > 0:
                lines = log.read_text(errors="replace").splitlines()
                print("\n".join(f"   | {line}" for line in lines[-args.tail:]), flush=True)
            results.append((row, measured, met, took))
    finally:
        if server is not None:
            server.stop(60.0)
    print(f"\ncard: {card}")
    print("| issue | row | measure | target | measured | met | s |")
    print("|---|---|---|---|---|---|---:|")
    for row, measured, met, took in sorted(results, key=lambda r: ROWS.index(r[0])):
        verdict = "-" if met is None else ("**met**" if met else "not met")
        print(f"| {row.issue} | {row.name} | {row.measure} | {row.target} | {measured} | {verdict} | {took:.0f} |")
    return 0 if all(met is not None for _, _, met, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
