"""The warm-up on CUDA (`ft.engine.core.warmup`): after it, requests of every batch size the engine runs
and short prompts of every prefill-graph bucket capture no new CUDA graph (what the warm-up is for:
no capture, and so no first-time compile, on a user's request), and the engine is left clean."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("kind", ["qwen3-next", "flash-next", "flash-next-nvfp4-kv"])
def test_no_triton_kernel_compiles_on_the_request_path_for_prompts_of_any_length(model, tmp_path, kind):
    """After the warm-up, prompts of lengths that are not multiples of 16, chunked at positions that
    are not either, prefilling in steps beside an odd and an even number of decoding rows: no Triton kernel
    compiles (Triton's `jit_post_compile_hook` sees none). Session 27 saw `_prefill_kernel` compile twice and
    `_pair_tiles_kernel` once after ready through `ft serve` (each a stall of every stream); session 60's c10 run
    saw the conv, chunk-state and decode-combine kernels compile in mixed steps of 9 prompts beside 1 decoding row
    and 2 beside 8. A failure lists each such compile's specialization beside the warm-up's of the same kernel.
    Both small models: the Qwen3-Next (bf16) and the NVFP4 Flash-Next (QSA, HyperConnections, the n-gram table),
    the latter also over an NVFP4 KV cache (the seeds' `--kv-cache-dtype nvfp4`: the decode attention's own
    kernels and launch options)."""
    from ft.engine.core.slow_steps import triton_compiles
    from gpu.small_model import small_flash_next

    if not triton_compiles.install():
        pytest.skip("this Triton has no knobs.runtime.jit_post_compile_hook to count compiles with")
    name = model if kind == "qwen3-next" else small_flash_next(tmp_path)
    kv = {"kv_cache_dtype": "nvfp4"} if kind.endswith("nvfp4-kv") else {}
    llm = LLM(model=name, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=16384,
              max_running_requests=24, prefill_graph_max_tokens=512, max_prefill_length=1000, **kv)
    e = llm.engine
    first = triton_compiles.count
    warm_up(e)
    warm, warm_ups = triton_compiles.count, triton_compiles.since(first)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    # (decoding rows, their prompts' length, the prompts that arrive beside them): steps of every size class up to
    # a chunk, the last round's rows with contexts long enough for the split decode attention (a mixed step runs
    # it eagerly)
    for streams, context, prompts in ((3, 33, (1537, 999, 130, 17)), (1, 33, (211,) * 9), (8, 33, (203, 190)),
                                      (2, 33, (30,)), (1, 33, (47,)), (4, 33, (100,)), (5, 900, (16,) * 16)):
        running = [e.add_request([(7 * i + j) % 1000 + 5 for i in range(context)], params) for j in range(streams)]
        while not all(s.output_ids for s in running):  # (their prompts prefill; then they decode)
            e.step()
        batch = [[(11 * i + 3 * j + n + len(prompts)) % 1000 + 5 for i in range(n)] for j, n in enumerate(prompts)]
        e.run_until_done(running + [e.add_request(p, params) for p in batch])
    late = triton_compiles.since(warm)
    seen = {}
    for name, signature in warm_ups:
        seen.setdefault(name, []).append(signature)
    report = "\n".join(f"after ready: {sig}\n  warm-up's: " + "\n  warm-up's: ".join(seen.get(name, ["none"]))
                       for name, sig in late)
    assert triton_compiles.count == warm, report


def test_the_slow_step_watch_names_a_compile_on_the_device(model, monkeypatch):
    """`ft.engine.core.slow_steps` on CUDA: Triton's compile hook is in (a kernel compiled between a step's mark and
    its end is named in the line: a kernel of this test's own, which no earlier test of the process compiled), the
    allocator is read, and after the warm-up a fresh engine's prompt pays for nothing (every step judged:
    SLOW_MIN_S 0)."""
    import triton
    import triton.language as tl

    import ft.engine.core.slow_steps as slow_steps
    from ft.engine.core.step_times import StepShape

    monkeypatch.setattr(slow_steps, "SLOW_MIN_S", 0.0)
    watch = slow_steps.SlowSteps(torch.device("cuda"))
    assert slow_steps.triton_compiles.available, "this Triton has no jit_post_compile_hook: compiles go uncounted"

    @triton.jit
    def _watched_kernel(p_x, N, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p_x + o, tl.load(p_x + o, mask=o < N) + 1.0, mask=o < N)

    x = torch.zeros(1000, device="cuda")
    mark = watch.mark()
    _watched_kernel[(8,)](x, x.numel(), BLOCK=128)
    torch.cuda.synchronize()
    line = watch.end("prefill", 0.5, StepShape(prompts=1, prompt_tokens=1000), mark)
    # (Triton names a kernel by its qualified name: this one is local to the test)
    assert line and "1 Triton kernel compiled or loaded (" in line and "._watched_kernel)" in line, line
    name, signature = slow_steps.triton_compiles.since(slow_steps.triton_compiles.count - 1)[0]
    assert name.endswith("._watched_kernel") and "._watched_kernel[num_warps=" in signature, signature
    assert float(x.sum()) == 1000.0

    llm = LLM(model=model, device="cuda", dtype="bfloat16", moe_backend="resident", num_tokens=8192,
              max_running_requests=4, prefill_graph_max_tokens=0, max_prefill_length=600)
    e = llm.engine
    warm_up(e)
    e.slow_steps.resume()  # (as `ft serve` has it)
    lines = []
    end = e.slow_steps.end
    e.slow_steps.end = lambda *a: lines.append(end(*a)) or lines[-1]
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    e.run_until_done([e.add_request([(17 * i) % 1000 + 5 for i in range(517)], params)])
    assert lines and not any(line and ("Triton" in line or "captured" in line) for line in lines), lines
