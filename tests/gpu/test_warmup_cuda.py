"""The warm-up on CUDA (`ft.engine.core.warmup`): after it, requests of every batch size the engine runs
and short prompts of every prefill-graph bucket capture no new CUDA graph (what the warm-up is for:
no capture, and so no first-time compile, on a user's request), and the engine is left clean."""

from __future__ import annotations

import pytest

from ft.engine import LLM, SamplingParams
from ft.engine.core.warmup import warm_up

pytestmark = pytest.mark.gpu


def test_no_graph_is_captured_on_the_request_path_after_the_warm_up(model):
    llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=8192,
              max_running_requests=8, prefill_graph_max_tokens=512)
    e = llm.engine
    report = warm_up(e)
    decode, prefill = e.runner.graphs, e.runner.prefill_graphs
    assert report.decode_batches == tuple(sorted(decode.buckets, reverse=True))
    assert set(prefill.buckets) <= set(report.prefill_lengths)
    assert not e.has_work and len(e.prefix_cache) == 0 and e.pools.kv.num_used_pages == 0
    before = (decode.captures, prefill.captures)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for b in (1, 3, 8):  # batches in every bucket's range
        e.run_until_done([e.add_request(list(range(100 + 9 * i, 120 + 9 * i)), params) for i in range(b)])
    for n in prefill.buckets:  # one prompt per prefill bucket (each runs alone: its graphs)
        e.run_until_done([e.add_request([(7 * i + n) % 1000 + 5 for i in range(n - 3)], params)])
    assert (decode.captures, prefill.captures) == before
    assert decode.replays > 0 and prefill.replays > 0


def test_no_triton_kernel_compiles_on_the_request_path_for_prompts_of_any_length(model):
    """After the warm-up, prompts of lengths that are not multiples of 16, chunked at positions that
    are not either, prefilling in steps that also decode: no Triton kernel compiles (Triton's
    `jit_post_compile_hook` sees none). Session 27 saw `_prefill_kernel` compile twice and
    `_pair_tiles_kernel` once after ready through `ft serve` (each a stall of every stream); their
    per-chunk integers are no longer specialized."""
    import triton

    runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if not hasattr(runtime_knobs, "jit_post_compile_hook"):
        pytest.skip(f"triton {triton.__version__} has no knobs.runtime.jit_post_compile_hook to count compiles with")
    llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=16384,
              max_running_requests=8, prefill_graph_max_tokens=512, max_prefill_length=1000)
    e = llm.engine
    warm_up(e)
    compiled = []
    hooks = runtime_knobs

    def seen(*args, **kwargs):
        info = kwargs.get("fn")
        compiled.append(getattr(info, "name", repr(info)))
        return False

    before, hooks.jit_post_compile_hook = hooks.jit_post_compile_hook, seen
    try:
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        running = [e.add_request(list(range(200 + i, 233 + i)), params) for i in range(3)]  # decoding streams
        for _ in range(4):
            e.step()
        prompts = [[(11 * i + n) % 1000 + 5 for i in range(n)] for n in (1537, 999, 130, 17)]
        e.run_until_done(running + [e.add_request(p, params) for p in prompts])
    finally:
        hooks.jit_post_compile_hook = before
    assert compiled == []


def test_the_slow_step_watch_names_a_first_compile_on_the_device(model, monkeypatch):
    """`ft.engine.core.slow_steps` on CUDA: Triton's compile hook is in (a fresh engine's first prefill names the
    kernels it compiled or loaded), the allocator is read, and after the warm-up the same prompt pays for nothing
    (every step judged: SLOW_MIN_S 0)."""
    import ft.engine.core.slow_steps as slow_steps

    monkeypatch.setattr(slow_steps, "SLOW_MIN_S", 0.0)
    llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=8192,
              max_running_requests=4, prefill_graph_max_tokens=0, max_prefill_length=600)
    e = llm.engine
    e.slow_steps.resume()  # (as `ft serve` has it)
    assert slow_steps.triton_compiles.available, "this Triton has no jit_post_compile_hook: compiles go uncounted"
    lines = []
    end = e.slow_steps.end
    e.slow_steps.end = lambda *a: lines.append(end(*a)) or lines[-1]
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    e.run_until_done([e.add_request([(13 * i) % 1000 + 5 for i in range(517)], params)])
    first = [line for line in lines if line]
    assert first and "Triton kernel" in first[0] and first[0].startswith("slow prefill step: "), first
    warm_up(e)
    lines.clear()
    e.run_until_done([e.add_request([(17 * i) % 1000 + 5 for i in range(517)], params)])
    assert not any(line and ("Triton" in line or "captured" in line) for line in lines), lines
