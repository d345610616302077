"""bench/targets.py on the CPU: its parsers and judges against output the benchmarks printed on the device
(session 62's logs), its rows' commands (--dry-run) and its refusals. The runs themselves need the device."""

from __future__ import annotations

import json

import pytest

from bench import targets

LADDER_OUT = """\
  ladder: auto off, step 32768 tokens, 7 rungs (kv tokens, 1..7): [65536] 98304 131072 163840 196608 229376 262144
32GiB kv 65536: {'tok_s': {1024: 235.46, 4096: 237.21}, 'hit_rate': 0.9331436157226562, 'host_mb_per_token': \
56.78462509277344, 'bound_tok_s': 880.5200336941756, 'serial_floor_tok_s': 579.7744113692252, 'ms_per_token': \
4.2156021591796895, 'policy_ms_per_token': 1.329038971679547, 'launch_ms_per_token': 0.022379294433660935, \
'card_left_gib': 1.34100341796875, 'slots': 15496, 'overlapped_steps': 4110}

| card | KV rung | slots | hit rate | host MB/token | tok/s @1024 | tok/s @4096 | bound tok/s |
|---|---|---|---|---|---|---|---|
| 32GiB | 64K | 15,496 | 93.3% | 57 | 235.5 | 237.2 | 881 |
"""

DECODE_OUT = """\
engine up in 43.2 s, geometry Geometry(moe_slots=20480, kv_tokens=16384, mamba_slots=32)
context 32 overlap batch 1: 267.4 tok/s, 3.700 ms a replay
context 32 overlap batch 8: 968.8 tok/s, 8.163 ms a replay

graphs captured 10 (0.65 s), replayed 630; overlapped decode steps 620
kv cache dtype: bf16; split-K decode attention aims at 264 programs, at most 128 splits

model                       context mode      batch     tok/s  ms/step roofline tok/s   ratio replay ms
fn40 (syn.)                      32 overlap       1    267.40     3.74           1405  19.03%     3.700
fn40 (syn.)                      32 overlap       8    968.77     8.26           2405  40.28%     8.163
"""


def test_ladder_lines_parse_and_judge():
    figures = targets.parse_ladder(LADDER_OUT, None)
    assert list(figures) == [("32GiB", 65536)] and figures[("32GiB", 65536)]["tok_s"][4096] == 237.21
    row = next(r for r in targets.ROWS if r.name == "offload-80b")
    measured, met = row.judge(figures)
    assert measured.startswith("237.2 tok/s (93.3% hits") and met is False
    fn = next(r for r in targets.ROWS if r.name == "fn-offload")
    assert fn.judge(figures) == (measured, True)  # (the same figures against 150)
    with pytest.raises(KeyError):  # a refused rung prints no line: no figures, not a verdict
        next(r for r in targets.ROWS if r.name == "fn-ladder").judge(figures)


def test_the_ladder_gain_is_the_low_rung_over_the_fixed_top_one():
    two = LADDER_OUT.replace("32GiB kv 65536", "16GiB kv 65536") + \
        "16GiB kv 262144: {'tok_s': {4096: 180.0}, 'hit_rate': 0.8, 'serial_floor_tok_s': 400.0}\n"
    figures = targets.parse_ladder(two, None)
    measured, met = next(r for r in targets.ROWS if r.name == "fn-ladder").judge(figures)
    assert measured.startswith("+31.8%") and met is False


def test_decode_table_rows_parse_and_only_they():
    assert targets.parse_decode(DECODE_OUT, None) == {1: 267.4, 8: 968.77}
    measured, met = next(r for r in targets.ROWS if r.name == "fn-resident").judge({1: 267.4, 8: 968.77})
    assert measured == "267.4 / 968.8" and met is False
    assert next(r for r in targets.ROWS if r.name == "fn-resident").judge({1: 250.0, 8: 1000.0})[1] is True


def test_serve_json_levels_judge_with_their_errors(tmp_path):
    level = {"output_throughput": 2150.0, "ttft_ms": {"p50": 900.0}, "itl_ms": {"p50": 15.0}, "errors": 0,
             "completed": 128}
    path = tmp_path / "c64-1k.json"
    path.write_text(json.dumps({"levels": [level]}))
    c64 = next(r for r in targets.ROWS if r.name == "c64-1k")
    assert c64.judge(c64.parse("", path)) == ("2,150.0", True)
    path.write_text(json.dumps({"levels": [{**level, "errors": 2}]}))
    assert c64.judge(c64.parse("", path)) == ("2,150.0 (2 errors)", False)
    lam = next(r for r in targets.ROWS if r.name == "c32-8k")
    path.write_text(json.dumps({"levels": [{**level, "ttft_ms": {"p50": 1600.0}}]}))
    measured, met = lam.judge(lam.parse("", path))
    assert measured == "2,150.0 tok/s, TTFT p50 1.60 s, ITL p50 15.0 ms" and met is False


def test_dry_run_names_one_server_and_each_row_s_command(capsys, tmp_path):
    assert targets.main(["--dry-run", "--rows", "c10-1k1k,offload-80b", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "-m ft.cli serve --model synthetic:bench/configs/qwen3-next-80b-a3b.json" in lines[0]
    assert "bench/serve.py --url http://127.0.0.1:PORT --concurrency 10 --num-prompts 30" in lines[1]
    assert lines[1].endswith(f"--json {tmp_path / 'c10-1k1k.json'}")
    assert lines[2].endswith("bench/ladder.py --cards 32GiB --rungs 65536 --tokens 1024,4096")


def test_unknown_rows_are_refused(capsys):
    with pytest.raises(SystemExit):
        targets.main(["--rows", "c64-1k,c99"])
    assert "unknown c99" in capsys.readouterr().err


def test_tail_prints_the_end_of_each_row_s_log_after_its_figure(capsys, tmp_path, monkeypatch):
    """--tail N: a row's last N log lines follow its figure (the logs stay behind where a device returns few files)."""
    row = targets.Row("echo", 0, "a figure", ">= 1", ("-c", "print('first'); print('second'); print('figure 3.5')"),
                      lambda text, _json: {"v": float(text.split()[-1])}, lambda f: (f"{f['v']:.1f}", f["v"] >= 1))
    monkeypatch.setattr(targets, "ROWS", [row])
    assert targets.main(["--rows", "echo", "--out", str(tmp_path), "--tail", "2"]) == 0
    out = capsys.readouterr().out
    assert "   3.5 in" in out and "   | second\n   | figure 3.5" in out and "| first" not in out
    assert (tmp_path / "echo.log").read_text().startswith("first")
    assert targets.main(["--rows", "echo", "--out", str(tmp_path)]) == 0  # no --tail: the figure alone
    assert "   | " not in capsys.readouterr().out
