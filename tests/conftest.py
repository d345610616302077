"""Shared fixtures: tiny random Qwen3-Next checkpoints made with transformers, a small checkpoint for
`ft serve`; the session fails at once when triton is required but missing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run in the interpreter on the CPU; triton reads this once, when it is first imported,
# so it is set here, before any test module imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")
# NOTE: one torch thread: the tensors here are tiny, and on a busy 2-core machine a second thread
# that loses its core makes every op wait for it (10x slower decode). `ft serve` subprocesses get the
# same through OMP_NUM_THREADS (tests/server_proc.py).
torch.set_num_threads(1)

# Property tests draw the same examples on every run (a CI gate must not find new ones at random)
# and have no per-example deadline (a loaded machine is slow, not wrong);
# HYPOTHESIS_PROFILE=explore draws fresh ones (and more where a test sets no max_examples) to hunt bugs.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
    _hypothesis_settings.register_profile("explore", max_examples=400, deadline=None)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis comes with the test extra
    pass


def _launch_patches_the_language_once() -> None:
    """The Triton interpreter (triton 3.x) patches `triton.language` at each kernel launch and again at
    every call of a `@triton.jit` helper inside it, although the launch's patches already cover it:
    each such call walks `tl`'s members with `inspect.getmembers` (~1 ms), a third of an interpreted
    MoE decode test's time. Here a helper's call skips that walk when every language module it sees
    is already patched (its builtins replaced); the launch's own patch, and its restore, are
    untouched. Without these interpreter internals (another triton), nothing changes."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "skips_patched", False):
        return

    def patch_lang_unless_patched(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope_type()  # a helper's call inside a launch: the launch patched these, and restores them
        return patch_lang(fn)

    patch_lang_unless_patched.skips_patched = True
    interpreter._patch_lang = patch_lang_unless_patched


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """The interpreter's patch (above) once every conftest has configured: not at import, because
    importing triton here, with TRITON_INTERPRET=1 still set, made its language's JIT functions
    interpreted ones, and tests/gpu (which clears the variable in its own pytest_configure when it runs
    alone) then failed at every launch (triton's gluon asserts a JITFunction: session 44, all 42 GPU
    tests of that run)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _launch_patches_the_language_once()


def triton_required() -> bool:
    """triton is a dependency on Linux (pyproject.toml); CI (`CI` set) needs it wherever it runs."""
    return sys.platform.startswith("linux") or bool(os.environ.get("CI"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fail the run at once, instead of skipping every Triton kernel test, when triton is required
    but cannot be imported."""
    if not triton_required():
        return
    try:
        import triton  # noqa: F401
    except ImportError as e:
        pytest.exit(f"triton is required here ({sys.platform}, CI={os.environ.get('CI', '')!r}) but "
                    f"`import triton` failed: {e}. Install the project's dependencies: pip install -e '.[test]'",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """The sm_90 compile check, when collected, starts now in the background on the cores the suite
    leaves idle (`test_kernels_compile.start_compile_jobs`); its test collects the report. Not under
    pytest-xdist: every worker collects every test, and only the one that runs it may start it (the test
    does, on the core its worker then leaves idle while it waits). There its file goes first (with
    `--no-loadscope-reorder` in pyproject's addopts: pytest-xdist otherwise hands out the files with the most
    tests first, which put this one-test file last, the other worker idle through its ~2 min; session 47)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.name != "test_kernels_compile_for_sm90")  # (stable: the rest keep their order)
        return
    cores = os.cpu_count() or 1
    for item in items:
        if item.name == "test_kernels_compile_for_sm90":
            # NOTE: a core left to the rest of the suite, unless there is little else to run
            item.module.start_compile_jobs(max(1, min(4, cores - 1 if len(items) > 20 else cores)))
            return


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    module = sys.modules.get("test_kernels_compile")
    if module is not None:
        module.stop_compile_jobs()


# Three small configurations that vary what the architecture lets vary.
TINY_CONFIGS = {
    "interval2-gqa2-top2": dict(
        num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "types-gqa4-top4-nonorm": dict(
        num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    ),
    "mha-top1-dense-mlp": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=1, norm_topk_prob=True, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    ),
}

BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, max_position_embeddings=512, linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
)


def make_hf_model(overrides: dict, seed: int = 0):
    """A random float32 transformers Qwen3NextForCausalLM with non-trivial norms and biases."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**{**BASE, **overrides})
    model = Qwen3NextForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("conv1d.weight"):
                p.normal_(0, 0.3)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
    return model


def save_checkpoint(model, path: Path) -> Path:
    from ft.tools.demo import write_tokenizer_files

    model.save_pretrained(path)
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    """(name, transformers model, checkpoint dir) for each tiny configuration."""
    name = request.param
    model = make_hf_model(TINY_CONFIGS[name])
    path = save_checkpoint(model, tmp_path_factory.mktemp(name))
    return name, model, path


@pytest.fixture(scope="session")
def tiny_one(tmp_path_factory):
    """The first tiny configuration only (for tests that need one model)."""
    name = next(iter(TINY_CONFIGS))
    model = make_hf_model(TINY_CONFIGS[name])
    return name, model, save_checkpoint(model, tmp_path_factory.mktemp(name + "-one"))


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory) -> Path:
    """The small checkpoint `ft serve` tests run when they do not need the demo (server_proc.py)."""
    from server_proc import write_serve_checkpoint

    return write_serve_checkpoint(tmp_path_factory.mktemp("serve"))
