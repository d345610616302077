"""The slow-step watch (`ft.engine.core.slow_steps`): which steps count as slow, what their line names, that the
engine accounts every step with its kind and rows, and that the warm-up runs with the watch paused."""

from __future__ import annotations

import logging

import pytest
import torch

from ft.engine.core.slow_steps import (MIN_HISTORY, SLOW_MIN_S, TOKEN_FLOOR, MemoryReading, SlowSteps, StepShape,
                                       triton_compiles)


class Counts:
    """Stand-ins for an engine's graph captures and rebuild history."""

    def __init__(self) -> None:
        self.captures = 0
        self.history: list[dict] = []


def watch() -> SlowSteps:
    return SlowSteps(torch.device("cpu"))


def run(w: SlowSteps, kind: str, seconds: float, shape: StepShape) -> str | None:
    return w.end(kind, seconds, shape, w.mark())


def test_a_decode_step_is_slow_at_three_times_its_usual_and_a_quarter_second():
    w = watch()
    rows = StepShape(decode_rows=10)
    assert run(w, "decode", 1.0, rows) is None  # no usual time yet and nothing paid: not judged
    for _ in range(MIN_HISTORY):
        assert run(w, "decode", 0.007, rows) is None
    assert run(w, "decode", 0.2, rows) is None  # 28x, but under SLOW_MIN_S
    line = run(w, "decode", 0.3, rows)
    assert line is not None and line.startswith("slow decode step: 300 ms, 42.9x what such a step has taken (7 ms)")
    assert "10 decoding rows" in line and "nothing counted" in line
    assert w.count == {"decode": 1, "mixed": 0, "prefill": 0}
    # the slow step stayed out of the history: the usual time is still 7 ms
    assert "(7 ms)" in run(w, "decode", 0.3, rows)


def test_prefill_and_mixed_steps_are_judged_by_their_time_a_token():
    w = watch()
    for _ in range(MIN_HISTORY):  # 30 us a token
        assert run(w, "prefill", 0.03 * 4096 / 1000, StepShape(1, 4096)) is None
    assert run(w, "prefill", 0.49, StepShape(1, 16384)) is None  # 16K tokens in 0.49 s: its usual
    short = StepShape(1, 100)  # charged TOKEN_FLOOR tokens: ~31 ms usual, so 0.08 s is not slow even at 27x a token
    assert run(w, "prefill", 0.08, short) is None
    line = run(w, "mixed", 0.979, StepShape(9, 9216, 1))
    assert line is not None
    assert line.startswith("slow mixed step: 979 ms, 3.5x what such a step has taken (277 ms): "
                           "9 prompts (9,216 tokens) beside 1 decoding row; during it: nothing counted"), line
    assert TOKEN_FLOOR == 1024 and w.count["mixed"] == 1


def test_a_step_that_paid_for_a_first_time_is_named_without_a_usual_time():
    counts = Counts()
    w = watch()
    mark = w.mark(counts.captures, counts.history)
    counts.captures += 1
    counts.history.append({"trigger": "mamba", "status": "ok"})
    for name in ("_decode_combine_kernel", "_decode_combine_kernel", "_prefill_kernel"):
        triton_compiles.record(name)
    line = w.end("prefill", SLOW_MIN_S, StepShape(2, 3000), mark, counts.captures, counts.history)
    assert line == ("slow prefill step: 250 ms, no usual time yet: 2 prompts (3,000 tokens); during it: 3 Triton "
                    "kernels compiled or loaded (_decode_combine_kernel, _prefill_kernel); 1 CUDA graph captured; "
                    "a mamba rebuild (ok)")
    # the same firsts in a step under SLOW_MIN_S: not slow, not named
    mark = w.mark(counts.captures, counts.history)
    counts.captures += 1
    assert w.end("decode", SLOW_MIN_S / 2, StepShape(decode_rows=1), mark, counts.captures, counts.history) is None


def test_with_a_usual_time_a_step_that_paid_for_something_but_took_its_usual_time_is_not_slow():
    """What was paid explains a slow step; it does not make one (an offloaded server's long prompt recalls the
    prefill reserve's loan, a rebuild, every time)."""
    counts = Counts()
    w = watch()
    for _ in range(MIN_HISTORY):
        assert run(w, "prefill", 0.5, StepShape(1, 16384)) is None
    mark = w.mark(counts.captures, counts.history)
    counts.history.append({"trigger": "loan", "status": "ok"})
    assert w.end("prefill", 0.55, StepShape(1, 16384), mark, counts.captures, counts.history) is None
    mark = w.mark(counts.captures, counts.history)
    counts.history.append({"trigger": "loan", "status": "ok"})
    line = w.end("prefill", 1.6, StepShape(1, 16384), mark, counts.captures, counts.history)
    assert line is not None and line.endswith("during it: a loan rebuild (ok)")


def test_memory_taken_during_a_slow_step_is_named_by_where_it_went():
    """The caching allocator's growth, the driver's count's growth beyond it (memory outside torch: kernel modules
    loaded on first use, library workspaces) and the pinned host blocks created (and the time their CUDA calls took);
    read at most every MEMORY_EVERY_S outside slow steps."""
    now = [0.0]
    memory = [MemoryReading(4 << 30, 70 << 30, host_blocks=3, host_alloc_us=40_000.0)]
    reads = []

    def read():
        reads.append(now[0])
        return memory[0]

    w = SlowSteps(torch.device("cpu"), clock=lambda: now[0], read_memory=read)
    assert reads == [0.0]
    for _ in range(MIN_HISTORY):  # fast steps: one reading a MEMORY_EVERY_S
        now[0] += 0.01
        assert run(w, "decode", 0.01, StepShape(decode_rows=2)) is None
    assert reads == [0.0]
    now[0] += 0.3
    assert run(w, "decode", 0.01, StepShape(decode_rows=2)) is None and len(reads) == 2
    mark = w.mark()
    memory[0] = MemoryReading((4 << 30) + (512 << 20), (70 << 30) + (512 << 20) + (200 << 20), host_blocks=10,
                              host_alloc_us=40_000.0 + 250_000.0)
    now[0] += 0.4
    line = w.end("mixed", 0.4, StepShape(3, 3072, 2), mark)
    assert line is not None and len(reads) == 3
    assert "the caching allocator took 512 MiB more from the driver (in the 400 ms between two readings" in line
    assert "200 MiB more of the card went outside torch's allocator (kernel modules loaded on first use" in line
    assert "7 pinned host blocks created, 250 ms in their CUDA calls (in the 400 ms" in line
    # nothing taken: a slow step's line names no memory
    for _ in range(MIN_HISTORY):
        run(w, "mixed", 0.03, StepShape(1, 1024))
    now[0] += 1.0
    line = run(w, "mixed", 1.0, StepShape(1, 1024))
    assert line is not None and "MiB" not in line and "nothing counted" in line


def test_a_paused_watch_judges_nothing_and_resumes_with_no_history():
    w = watch()
    w.pause()
    for _ in range(MIN_HISTORY):
        assert run(w, "decode", 0.007, StepShape(decode_rows=1)) is None
    assert run(w, "decode", 5.0, StepShape(decode_rows=1)) is None and w.count["decode"] == 0
    w.resume()
    assert run(w, "decode", 5.0, StepShape(decode_rows=1)) is None  # the paused steps made no usual time


def test_the_engine_accounts_each_step_by_kind_and_rows_and_logs_a_slow_one(tiny_one, caplog):
    from ft.engine import LLM, SamplingParams

    e = LLM(model=str(tiny_one[2]), device="cpu", max_running_requests=4, max_prefill_length=64).engine
    assert e.slow_steps.paused  # (a library engine's watch is off until resumed: `ft serve` resumes it when ready)
    e.slow_steps.resume()
    seen = []
    end = e.slow_steps.end

    def recording(kind, seconds, shape, mark, *counts):
        seen.append((kind, shape))
        return end(kind, seconds, shape, mark, *counts)

    e.slow_steps.end = recording
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    first = e.add_request(list(range(5, 45)), params)
    e.step()  # the first prompt alone
    second = e.add_request(list(range(50, 70)), params)
    e.run_until_done([first, second])
    assert seen[0] == ("prefill", StepShape(1, 40, 0))
    assert seen[1] == ("mixed", StepShape(1, 20, 1))  # the second prompt beside the first's decode
    assert seen[-1][0] == "decode" and all(s.prompts == 0 for k, s in seen if k == "decode")
    assert sum(e.step_times.count.values()) == len(seen)
    # a step that takes far longer than the usual: a warning from the engine's logger, and counted
    del e.slow_steps.end
    for _ in range(MIN_HISTORY):
        e.slow_steps.end("decode", 0.01, StepShape(decode_rows=1), e.slow_steps.mark())
    e.slow_steps.end = lambda kind, seconds, shape, mark, *counts: end(kind, 1.0, shape, mark, *counts)
    with caplog.at_level(logging.WARNING, logger="ft.engine"):
        e.run_until_done([e.add_request(list(range(80, 90)), SamplingParams(max_new_tokens=2, ignore_eos=True))])
    assert any(r.getMessage().startswith("slow decode step: 1,000 ms") for r in caplog.records)
    assert e.stats().slow_steps["decode"] >= 1



def test_the_compile_record_keeps_the_newest_and_counts_them_all():
    """`TritonCompiles`: a long-lived server's compiles are counted without bound, their names and
    specializations kept for the newest `KEPT_COMPILES` only; `since(n)` gives what is kept of compile n on."""
    from ft.engine.core.slow_steps import KEPT_COMPILES, TritonCompiles

    record = TritonCompiles()
    for i in range(KEPT_COMPILES + 5):
        record.record(f"k{i}", f"k{i}[num_warps=4]()")
    assert record.count == KEPT_COMPILES + 5
    assert record.since(0)[0] == ("k5", "k5[num_warps=4]()") and len(record.since(0)) == KEPT_COMPILES
    assert record.since(KEPT_COMPILES + 3) == [(f"k{KEPT_COMPILES + 3}", f"k{KEPT_COMPILES + 3}[num_warps=4]()"),
                                              (f"k{KEPT_COMPILES + 4}", f"k{KEPT_COMPILES + 4}[num_warps=4]()")]
    assert record.since(record.count) == []


def test_a_compile_is_described_by_its_arguments_constants_and_alignment():
    """`compile_signature` from the keywords Triton's `jit_post_compile_hook` passes (their shape in triton 3.x:
    `compile` holds the signature, the constants by argument index and the divisibility attributes); Triton's
    `repr` alone where those are missing."""
    from ft.engine.core.slow_steps import compile_signature

    hook = {"repr": "_k[num_warps=4, num_stages=3](p_x: *bf16, N: i32)",
            "compile": {"signature": {"p_x": "*bf16", "p_s": "*i64", "N": "i32", "B": "constexpr",
                                      "BLOCK": "constexpr"},
                        "constants": {(3,): 1, (4,): 128}, "configs": [{(0,): [["tt.divisibility", 16]]}]}}
    assert compile_signature(hook) == ("_k[num_warps=4, num_stages=3](p_x: *bf16, p_s: *i64, N: i32; constants B=1, "
                                       "BLOCK=128; divisible by 16: p_x)")
    assert compile_signature({"repr": "_k[num_warps=4](p_x)"}) == "_k[num_warps=4](p_x)"
    assert compile_signature({}) == ""


def test_the_allocators_growth_alone_is_no_first_time():
    """Before a kind has a usual time, a step that only took more memory into torch's caching allocator (a prefill
    of more tokens than any before, at its usual rate) is not slow; memory taken outside torch's allocator is a
    first time (kernel modules loaded on first use); with a usual time, the time decides and the growth explains."""
    now = [0.0]
    memory = [MemoryReading(4 << 30, 70 << 30)]
    w = SlowSteps(torch.device("cpu"), clock=lambda: now[0], read_memory=lambda: memory[0])
    mark = w.mark()
    memory[0] = MemoryReading((4 << 30) + (160 << 20), (70 << 30) + (160 << 20))
    now[0] += 0.3
    assert w.end("prefill", 0.29, StepShape(10, 10240), mark) is None
    mark = w.mark()
    memory[0] = MemoryReading((4 << 30) + (320 << 20), (70 << 30) + (320 << 20) + (64 << 20))
    now[0] += 0.3
    line = w.end("prefill", 0.29, StepShape(10, 10240), mark)
    assert line is not None and "64 MiB more of the card went outside torch's allocator" in line
    assert "the caching allocator took 160 MiB more" in line
