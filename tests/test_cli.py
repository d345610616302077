"""The `ft` command line: light imports, `ft generate` on a checkpoint, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ft.cli import main


def test_help_does_not_import_torch():
    code = "import sys; from ft.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "generate" in out and "quantize" in out and out.strip().endswith("False")


def test_generate_json(tiny_one, capsys):
    rc = main(["generate", "--model", str(tiny_one[2]), "--prompt", "hello", "--max-new-tokens", "5",
               "--ignore-eos", "--json", "--page-size", "16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length" and out["prompt_tokens"] > 0


def test_generate_streams_text(tiny_one, capsys):
    rc = main(["generate", "--model", str(tiny_one[2]), "--prompt", "hi", "--max-new-tokens", "4", "--chat"])
    assert rc == 0
    assert "tokens/s" in capsys.readouterr().err


def test_generate_reports_errors(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    assert rc == 1 and "no config.json" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


@pytest.mark.parametrize("text,expected", [("16GiB", 16 * 2**30), ("4.8GiB", int(4.8 * 2**30)), ("512MiB", 512 * 2**20),
                                           ("1000000", 1000000)])
def test_byte_size_flags_take_the_forms_help_shows(text, expected):
    """`--gpu-memory-limit 16GiB` and `--cache-budget 4.8GiB`, as `--help` and the README write them."""
    import argparse

    from ft.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--gpu-memory-limit", text, "--cache-budget", text]))
    assert cfg.gpu_memory_limit == cfg.cache_budget == expected
    assert p.parse_args(["--num-tokens", "4096"]).num_tokens == 4096  # plain ints stay ints
