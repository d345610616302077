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
    err = capsys.readouterr().err
    assert "tokens/s" in err
    # stderr is no terminal here: one line per loading phase, no progress bar
    assert f"ft generate: loading {tiny_one[2]} (" in err and "loading weights" not in err


def test_generate_reports_errors(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 1 and f"model directory {tmp_path / 'missing'} does not exist" in err
    assert len(err.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    rc = main(["generate", str(tmp_path / "empty"), "--prompt", "x"])  # the positional MODEL
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


# --------------------------------------------------------------------- vLLM / SGLang spellings
def _config(*argv: str):
    from ft.cli import build_parser
    from ft.engine_args import engine_config_from_args

    return engine_config_from_args(build_parser("serve").parse_args(["serve", *argv]))


@pytest.mark.parametrize("argv,field,value", [
    (["--max-model-len", "1234"], "max_seq_len_override", 1234),
    (["--context-length", "2345"], "max_seq_len_override", 2345),
    (["--max-seq-len-override", "3456"], "max_seq_len_override", 3456),
    (["--max-num-seqs", "3"], "max_running_requests", 3),
    (["--no-enable-prefix-caching"], "enable_prefix_cache", False),
    (["--no-enable-prefix-cache", "--enable-prefix-caching"], "enable_prefix_cache", True),
    (["--gpu-memory-utilization", "0.5"], "memory_ratio", 0.5),
    (["--mem-fraction-static", "0.25"], "memory_ratio", 0.25),
    (["-tp", "1", "--pipeline-parallel-size", "1", "--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    (["--tokenizer", "/tok", "--chat-template", "t.jinja"], "tokenizer", "/tok"),
    (["--chat-template", "t.jinja"], "chat_template", "t.jinja"),
])
def test_other_engines_flag_names_set_our_fields(argv, field, value):
    assert getattr(_config(*argv), field) == value


def test_the_seeds_server_command_line_parses_as_written():
    """The seed issue's `ft serve` line, flag for flag (users copy it): each flag lands in its field."""
    from ft.errors import ConfigError

    line = ("--model ~/models/Qwen3.8-Flash-Next-NVFP4 --kv-cache-dtype nvfp4 --num-tokens 262144 "
            "--max-seq-len-override 262144 --max-running-requests 1 --cuda-graph-max-bs 1 --moe-cache-size 512 "
            "--disable-moe-prefill-overlap --memory-ratio 0.95 --max-prefill-length 4096")
    cfg = _config(*line.split())
    assert (cfg.kv_cache_dtype, cfg.num_tokens, cfg.max_seq_len_override, cfg.max_running_requests) == \
        ("nvfp4", 262144, 262144, 1)
    assert (cfg.cuda_graph_max_bs, cfg.moe_cache_size, cfg.memory_ratio, cfg.max_prefill_length) == (1, 512, 0.95, 4096)
    assert cfg.disable_moe_prefill_overlap and cfg.moe_backend == "offload"
    with pytest.raises(ConfigError, match="--disable-moe-prefill-overlap"):
        _config("--moe-backend", "resident", "--disable-moe-prefill-overlap")


@pytest.mark.parametrize(("argv", "graphs"), [
    ([], 8), (["--max-num-seqs", "48"], 48), (["--max-num-seqs", "48", "--cuda-graph-max-bs", "16"], 16),
    (["--cuda-graph-max-bs", "64"], 8), (["--max-num-seqs", "48", "--disable-cuda-graph"], 0),
    (["--cuda-graph-max-bs", "0"], 0),
])
def test_decode_graphs_cover_every_running_batch_by_default(argv, graphs):
    """The decode graphs' largest bucket: every batch the engine runs (--max-num-seqs) unless
    --cuda-graph-max-bs caps it; none with --disable-cuda-graph."""
    assert _config(*argv).decode_graph_max_bs == graphs


@pytest.mark.parametrize(("argv", "buckets", "graphs"), [
    (["--max-num-seqs", "16", "--cuda-graph-bs", "1,2,4,6,8,10,12,14,16"], (1, 2, 4, 6, 8, 10, 12, 14, 16), 16),
    (["--max-num-seqs", "16", "--cuda-graph-bs", "8 1, 4,4"], (1, 4, 8), 8),  # sorted, once each; eager above 8
    (["--max-num-seqs", "8", "--cuda-graph-bs", "1,2,4,8,16"], (1, 2, 4, 8), 8),  # never past the running limit
    (["--max-num-seqs", "16", "--cuda-graph-bs", "1,8,16", "--cuda-graph-max-bs", "8"], (1, 8), 8),
    (["--max-num-seqs", "16"], None, 16),  # the default ladder (decode_graphs.batch_buckets)
])
def test_cuda_graph_bs_lists_the_decode_graphs(argv, buckets, graphs):
    config = _config(*argv)
    assert config.decode_graph_buckets == buckets and config.decode_graph_max_bs == graphs


@pytest.mark.parametrize("value", ["0,4", "", "1,x"])
def test_cuda_graph_bs_refuses_what_is_no_batch_size(value):
    from ft.errors import ConfigError

    with pytest.raises(ConfigError, match="--cuda-graph-bs"):
        _config("--cuda-graph-bs", value)


def test_memory_ratio_help_says_what_it_is_a_fraction_of(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--memory-ratio X, --gpu-memory-utilization X, --mem-fraction-static X" in text
    assert "FREE once the weights are loaded" in text and "TOTAL memory" in text


def test_positional_model_is_the_model_flag(capsys):
    assert _config("/ckpt/a").model == "/ckpt/a"
    assert _config("/ckpt/a", "--model", "/ckpt/a/").model == "/ckpt/a"  # the same folder twice is fine
    assert _config("--model", "/ckpt/b").model == "/ckpt/b"
    assert main(["serve", "/ckpt/a", "--model", "/ckpt/b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "two models given: /ckpt/a (positional) and --model /ckpt/b" in err[0]


def _run_cli(*argv: str) -> tuple[int, str, bool]:
    """`ft ARGV` in a fresh interpreter: (exit code, stderr, whether torch got imported)."""
    code = ("import sys; from ft.cli import main\ntry: rc = main(sys.argv[1:])\nexcept SystemExit as e: rc = e.code\n"
            "print('torch' in sys.modules); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, check=False)
    return p.returncode, p.stderr, p.stdout.strip().endswith("True")


@pytest.mark.parametrize("flag", ["-pp", "--pipeline-parallel-size"])
def test_pipeline_parallelism_is_refused_in_one_line_before_loading(flag):
    rc, err, torch_loaded = _run_cli("serve", flag, "2", "--port", "0")
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1, err
    assert "use --tensor-parallel-size 2" in lines[0] and lines[0].startswith("ft serve: error: --")
    assert not torch_loaded


@pytest.mark.parametrize("flag", ["--model-overrides", "--hf-overrides", "--json-model-override-args"])
def test_model_overrides_that_are_no_json_object_are_refused_in_one_line_before_loading(flag):
    rc, err, torch_loaded = _run_cli("serve", flag, '{"rope_scaling": ', "--port", "0")
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1, err
    assert "--model-overrides: not JSON" in lines[0] and lines[0].startswith("ft serve: error: --")
    assert not torch_loaded


@pytest.mark.parametrize("argv,usage,hint", [
    (["serve", "--mem", "1"], "usage: ft serve", "did you mean --memory-ratio?"),
    (["generate", "--prompt", "x", "--mem", "1"], "usage: ft generate", "did you mean --memory-ratio?"),
    (["serve", "--max-num-seq", "4"], "usage: ft serve", "did you mean --max-num-seqs?"),
    (["serve", "--gpu-memory-utilisation", "0.5"], "usage: ft serve", "did you mean --gpu-memory-utilization"),
    (["ctl", "cache", "--dry"], "usage: ft ctl cache", "did you mean --dry-run?"),
    (["top", "--refr", "2"], "usage: ft top", "did you mean --refresh?"),
    (["quantize", "a", "b", "--quit"], "usage: ft quantize", "did you mean --quiet?"),
    (["srve"], "usage: ft ", "did you mean serve?"),
])
def test_bad_flag_shows_the_subcommands_usage_and_a_suggestion(argv, usage, hint, capsys):
    """No abbreviations (`--mem 1` once meant --memory-ratio 1); the error is the subcommand's."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(usage) and hint in err, err
    if argv[0] != "srve":
        assert "usage: ft [-h]" not in err and "COMMAND" not in err


def test_unknown_flag_far_from_any_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--zzzzqqq"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err


def _subparsers():
    """(name, parser) of every subcommand and sub-subcommand."""
    import argparse

    from ft.cli import COMMANDS, build_parser

    out = []

    def walk(prefix, p):
        out.append((prefix, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(f"{prefix} {name}", sp)

    for command in COMMANDS:
        top = build_parser(command)
        sub = next(a for a in top._actions if a.dest == "command")
        walk(command, sub.choices[command])
    return out


def test_every_flag_has_help_and_shows_its_default():
    import argparse

    for name, p in _subparsers():
        assert not p.allow_abbrev, name
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            assert a.help, f"ft {name} {a.option_strings or a.dest}: no help"
            if not a.option_strings or a.required or (a.nargs == 0 and a.default is None):
                continue  # positionals, required options and store_const switches have no default
            assert "(default" in fmt._expand_help(a), f"ft {name} {a.option_strings}: no default in --help"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--port PORT TCP port to listen on (0: any free port) (default: 30000)",
                 "--page-size N tokens per KV page (default: 64)", "(default: on)", "--progress, --no-progress"):
        assert text in out, text


# ------------------------------------------------------------------ --tokenizer, --chat-template
def _bare_checkpoint(src, dst):
    """A copy of checkpoint `src` with no tokenizer files and no chat template (weights linked)."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


def test_tokenizer_and_chat_template_flags_serve_a_bare_checkpoint(serve_checkpoint, tmp_path, capsys):
    """A checkpoint without tokenizer.json or chat template runs with --tokenizer DIR and
    --chat-template FILE: the prompt is the given template's rendering, tokenized by DIR's tokenizer."""
    from ft.engine.text.tokenizer import Tokenizer

    bare = _bare_checkpoint(serve_checkpoint, tmp_path / "bare")
    rc = main(["generate", str(bare), "--prompt", "hi", "--chat", "--json", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "tokenizer.json not found" in err[0] and "--tokenizer DIR" in err[0]

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    rc = main(["generate", str(bare), "--tokenizer", str(serve_checkpoint), "--chat-template", str(template),
               "--prompt", "hi", "--chat", "--json", "--max-new-tokens", "2", "--page-size", "16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == len(Tokenizer.from_dir(serve_checkpoint).encode("<<hi>>"))


def test_chat_template_is_a_file_or_the_text_itself(tmp_path):
    from ft.engine.text.tokenizer import ChatTemplateError, resolve_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}!")
    assert resolve_chat_template(str(f)) == "{{ messages[0].content }}!"
    assert resolve_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert resolve_chat_template("x" * 5000 + "{{ 1 }}").endswith("{{ 1 }}")  # too long to be a file name
    for bad, why in ((str(tmp_path / "missing.jinja"), "no file"), (str(tmp_path), "is a directory"),
                     ("{% for %}", "does not compile")):
        with pytest.raises(ChatTemplateError, match=why) as e:
            resolve_chat_template(bad)
        assert "\n" not in str(e.value) and str(e.value).startswith("--chat-template: ")


def test_chat_template_replaces_the_checkpoints_and_eos_comes_from_the_model(serve_checkpoint, tmp_path):
    from ft.engine.text.tokenizer import Tokenizer

    own = Tokenizer.from_dir(serve_checkpoint)
    assert own.chat_template and "<<" not in own.apply_chat_template([{"role": "user", "content": "a"}])
    tok = Tokenizer.from_dir(serve_checkpoint, chat_template="<<{{ messages[0].content }}>>")
    assert tok.chat_templates == {"default": "<<{{ messages[0].content }}>>"}
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "<<a>>"
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    other = Tokenizer.from_dir(serve_checkpoint, model_dir=model)  # --tokenizer: EOS ids of the model's files
    assert {7, 8} <= other.eos_token_ids and not {7, 8} <= own.eos_token_ids


@pytest.mark.parametrize("argv,tty,expected", [([], True, True), ([], False, False), (["--no-progress"], True, False),
                                               (["--progress"], False, True)])
def test_progress_defaults_to_whether_stderr_is_a_terminal(argv, tty, expected):
    from ft.cli import build_parser
    from ft.engine_args import engine_config_from_args

    class Stream:
        def isatty(self):
            return tty

    args = build_parser("serve").parse_args(["serve", *argv])
    assert engine_config_from_args(args, stream=Stream()).progress is expected
