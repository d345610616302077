"""bench/serve.py, the serving benchmark: a small run against an `ft serve` it starts itself on the
CPU (the small "ft-tiny" checkpoint), its statistics on fixed numbers, its prompts, that it does not
import torch, and its one-line error when the server cannot be reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve import Prompts, summarize
from tests.server_proc import SERVE_MODEL, write_serve_checkpoint

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "serve.py"
OUTPUT_LEN = 4
LEVELS = (1, 2)
PROMPTS = 4


def _bench(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    # one torch thread in the server it starts (as tests/server_proc.py gives its servers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_summarize_on_fixed_numbers():
    s = summarize(range(1, 101))  # numpy's linear interpolation between the closest ranks
    assert s["n"] == 100
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["max"] == 100
    s = summarize([4.0, 1.0, 3.0, 2.0])  # order does not matter
    assert (s["mean"], s["p50"], s["p90"], s["p99"]) == pytest.approx((2.5, 2.5, 3.7, 3.97))
    assert summarize([7.0]) == {"n": 1, "mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0, "max": 7.0}
    assert summarize([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_prompts_are_seeded_in_range_and_start_differently():
    a, b = Prompts(320, 8, 16, seed=5), Prompts(320, 8, 16, seed=5)
    pa, pb = [a.next() for _ in range(50)], [b.next() for _ in range(50)]
    assert [len(p) for p in pa] == [len(p) for p in pb]  # lengths seeded (the per-run nonce is not)
    assert all(8 <= len(p) <= 16 and all(0 <= t < 320 for t in p) for p in pa)
    assert len({tuple(p[:a.marker]) for p in pa}) == 50  # no two prompts share a first page
    assert [p[a.marker:] for p in pa] == [p[b.marker:] for p in pb]


def test_the_client_does_not_import_torch():
    code = "import sys; import bench.serve; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_unreachable_url_is_one_line_and_nonzero():
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        r = _bench("--url", f"http://127.0.0.1:{port}", "--concurrency", "1", "--num-prompts", "1", timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "cannot reach" in lines[0] and str(port) in lines[0]
    assert "Traceback" not in r.stderr


def test_a_server_log_that_is_the_commands_own_output_is_refused_in_one_line(tmp_path):
    """`bench/serve.py ... --serve-log F > F`: the server's log and the command's output would write over each other."""
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        r = subprocess.run([sys.executable, "bench/serve.py", "--serve-args", "--model demo", "--serve-log", str(log)],
                           cwd=REPO, stdout=out, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "a file of its own" in r.stderr
    from bench.serve import writes_to

    with open(log) as f:
        assert writes_to(str(log), f.fileno()) and not writes_to(str(tmp_path / "other.log"), f.fileno())


def test_serving_benchmark_against_a_started_server(tmp_path):
    ckpt = write_serve_checkpoint(tmp_path)
    out = tmp_path / "bench.json"
    r = _bench("--serve-args", f"--model {ckpt} --device cpu --log-level warning",
               "--input-len-range", "8:16", "--output-len", str(OUTPUT_LEN),
               "--concurrency", ",".join(map(str, LEVELS)),
               "--num-prompts", str(PROMPTS), "--warmup", "1", "--metrics-interval", "0.05", "--json", str(out))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"

    # the markdown table is last on stdout: a header, a rule, one row per level
    lines = r.stdout.strip().splitlines()
    rows = lines[-len(LEVELS):]
    header, rule = lines[-len(LEVELS) - 2], lines[-len(LEVELS) - 1]
    assert header.startswith("| concurrency | requests | errors |") and "output tok/s" in header, r.stdout
    assert "TTFT p99 ms" in header and "/metrics p99 ms" in header
    assert set(rule) <= set("|-:")
    cols = [c.strip() for c in header.strip("|").split("|")]
    for level, row in zip(LEVELS, rows):
        cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
        assert cells["concurrency"] == str(level) and cells["requests"] == str(PROMPTS) and cells["errors"] == "0"
        assert float(cells["output tok/s"].replace(",", "")) > 0
    assert "server stopped (exit 0)" in r.stdout  # the server it started is gone

    record = json.loads(out.read_text())
    assert record["server"]["model"] == SERVE_MODEL and record["server"]["started"]
    assert record["server"]["prefill"] is None  # --log-level warning: no banner to read
    assert record["date"] and "--serve-args" in record["command"]
    levels = record["levels"]
    assert [lv["concurrency"] for lv in levels] == list(LEVELS)
    for lv in levels:
        assert (lv["completed"], lv["errors"], lv["short"], lv["first_error"]) == (PROMPTS, 0, 0, None), lv
        assert lv["output_tokens"] == PROMPTS * OUTPUT_LEN
        assert lv["output_throughput"] > 0 and lv["total_token_throughput"] > lv["output_throughput"]
        assert lv["cached_prompt_tokens"] == 0  # distinct prompts: nothing served from the prefix cache
        assert len(lv["requests"]) == PROMPTS
        for req in lv["requests"]:
            assert req["ok"] and req["output_tokens"] == OUTPUT_LEN and req["finish_reason"] == "length", req
            assert 8 <= req["prompt_len"] <= 16
            assert 0 < req["ttft_ms"] <= req["e2e_ms"], req
            assert req["tpot_ms"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = lv[key]
            assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
        assert lv["ttft_ms"]["p99"] <= lv["e2e_ms"]["max"]
        for probe in (lv["metrics_probe"], lv["metrics_probe_client_loop"]):  # its own process's, the client loop's
            assert probe["count"] >= 1 and probe["errors"] == 0 and 0 < probe["p50"] <= probe["p99"] <= probe["max"]
        assert lv["device_memory"] is None  # a CPU server has no driver count (tests/test_device_memory.py)
        steps = lv["engine_steps"]  # the server's step counters across the level (the warm-up before them)
        assert sum(v["seconds"] for v in steps.values()) <= lv["duration_s"]
        assert all(v["seconds"] > 0 for v in steps.values() if v["steps"]), steps
        if lv["concurrency"] == 1:  # a request at a time: its prompt one prefill step, its other tokens decode steps
            assert {k: v["steps"] for k, v in steps.items()} == {"decode": PROMPTS * (OUTPUT_LEN - 1), "mixed": 0,
                                                                 "prefill": PROMPTS}, steps
        else:  # every token of every request came out of some step
            assert steps["decode"]["steps"] + steps["mixed"]["steps"] + steps["prefill"]["steps"] >= OUTPUT_LEN
    assert "engine steps: decode 12 in " in r.stdout, r.stdout


def test_ab_runs_the_same_levels_on_a_second_server_and_compares(tmp_path):
    """--ab EXTRA: a second server with the flag runs the same level; the comparison table is last, with both
    servers' geometry lines (the flag here changes the KV size, so they differ), and --json keeps both runs."""
    ckpt = write_serve_checkpoint(tmp_path)
    out = tmp_path / "ab.json"
    r = _bench("--serve-args", f"--model {ckpt} --device cpu", "--ab", "--num-tokens 1024",
               "--input-len", "8", "--output-len", "2", "--concurrency", "1", "--num-prompts", "2", "--warmup", "0",
               "--metrics-interval", "0.2", "--json", str(out))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = r.stdout.strip().splitlines()
    assert lines[-2].startswith("|") and set(lines[-2]) <= set("|-:") and lines[-3].startswith("| level |")
    cells = [c.strip() for c in lines[-1].strip("|").split("|")]
    assert cells[0] == "1" and float(cells[3]) > 0
    geometry = [line for line in lines if line.startswith(("A geometry:", "B geometry:"))]
    assert len(geometry) == 2 and all("kv" in g for g in geometry) and geometry[0][2:] != geometry[1][2:]
    assert "kv 1024 tokens" in geometry[1] and r.stdout.count("server stopped (exit 0)") == 2
    # each started server's geometry and prefill chunk, said as it is up (rows on other cards differ by them)
    started = [line for line in lines if line.startswith("server geometry: moe ")]
    assert len(started) == 2 and all("; prefill: chunks of 4096 tokens" in line for line in started), started
    record = json.loads(out.read_text())
    assert record["server"]["prefill"].startswith("prefill: chunks of 4096 tokens")
    assert record["ab"]["extra"] == "--num-tokens 1024" and len(record["ab"]["levels"]) == len(record["levels"]) == 1
    assert record["ab"]["levels"][0]["completed"] == 2 and "kv 1024" in record["ab"]["geometry"]


def test_routing_trace_serves_a_traced_copy_of_the_synthetic_config():
    """--routing-trace: the started server's --model names a copy of the synthetic config with
    "routing_trace": true, every other flag kept; a model that is not synthetic is refused."""
    import shlex

    from bench.serve import traced_serve_args

    config = REPO / "bench" / "configs" / "qwen3-next-80b-a3b.json"
    for form in (f"--model synthetic:{config}", f"--model=synthetic:{config}"):
        text, path = traced_serve_args(f"{form} --gpu-memory-limit 32GiB --port 0")
        args = shlex.split(text)
        model = args[0]
        assert model == f"--model=synthetic:{path}"
        assert model.startswith("--model=synthetic:") and args[1:] == ["--gpu-memory-limit", "32GiB", "--port", "0"]
        traced = json.loads(Path(model.split(":", 1)[1]).read_text())
        assert traced.pop("routing_trace") is True and traced == json.loads(config.read_text())
        Path(path).unlink()
    with pytest.raises(SystemExit, match="synthetic"):
        traced_serve_args("--model demo")
    run = subprocess.run([sys.executable, str(SCRIPT), "--url", "http://127.0.0.1:9", "--routing-trace"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--routing-trace applies to a server it starts" in run.stderr


def test_a_levels_disk_table_reads_come_from_the_servers_counters():
    """`ngram_split`: the rows and seconds between two /metrics reads; None where the server read none (its
    table in host memory, or none) or a read is missing."""
    from bench.serve import NGRAM_SERIES, ngram_split

    rows, secs = NGRAM_SERIES
    before = {(rows, None): 100.0, (secs, None): 0.5}
    assert ngram_split(before, {(rows, None): 1860.0, (secs, None): 0.75}) == {"rows": 1760, "seconds": 0.25}
    assert ngram_split(before, before) is None and ngram_split(None, before) is None
    assert ngram_split({}, {}) is None  # (a server without a disk table exports zeros)


def test_a_levels_steps_line_names_its_slow_steps():
    """The server's slow steps of a level (`ft_engine_slow_steps_total`) beside each kind's steps, pointing at the
    server's log, where each has its line; a server that does not count them reads as none."""
    from bench.serve import step_split, steps_line

    before = {("ft_engine_steps_total", "mixed"): 1.0, ("ft_engine_step_seconds_total", "mixed"): 0.3}
    after = {("ft_engine_steps_total", "decode"): 10.0, ("ft_engine_step_seconds_total", "decode"): 0.07,
             ("ft_engine_steps_total", "mixed"): 3.0, ("ft_engine_step_seconds_total", "mixed"): 2.26,
             ("ft_engine_slow_steps_total", "mixed"): 2.0}
    split = step_split(before, after)
    assert split["mixed"] == {"steps": 2, "seconds": pytest.approx(1.96), "slow": 2}
    line = steps_line(split, 3.0)
    assert "mixed 2 in 1.96 s (980.0 ms each; 2 slow: see the server's log)" in line, line
    assert "decode 10 in 0.07 s (7.0 ms each)," in line and "prefill 0 in 0.00 s;" in line


def test_the_servers_slow_step_lines_are_found_in_its_log():
    """A started server's slow steps are printed from its log after the levels (their counts are in each level's
    steps line): the warning lines `ft.engine.core.slow_steps` writes, whatever the log's prefix."""
    from bench.serve import slow_step_lines

    log = "\n".join([
        "2026-12-07 09:09:17 INFO ft.stats: running 10, waiting 0, prompt 1126.3 tok/s",
        "2026-12-07 09:09:18 WARNING ft.engine: slow mixed step: 979 ms, 3.6x what such a step has taken (272 ms): "
        "9 prompts (9,216 tokens) beside 1 decoding row; during it: nothing counted",
        "slow decode step: 300 ms, no usual time yet: 8 decoding rows; during it: 1 CUDA graph captured",
        "a slow client step: not the engine's",
        "ft serve: warm-up: decode batches of 64, 56",
    ])
    assert slow_step_lines(log) == [
        "slow mixed step: 979 ms, 3.6x what such a step has taken (272 ms): 9 prompts (9,216 tokens) beside 1 "
        "decoding row; during it: nothing counted",
        "slow decode step: 300 ms, no usual time yet: 8 decoding rows; during it: 1 CUDA graph captured"]
