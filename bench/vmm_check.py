"""Device check of ft.engine.memory.vmm on a CUDA GPU (not a test; CI has no GPU).

    python3 bench/vmm_check.py

Reserves, grows, fills, shrinks and regrows a VMM buffer; checks kept data, the stable base
address, that free memory rises right after a shrink, that CUDA graphs captured over the buffer
replay correctly after a shrink and a regrow, times mapping and unmapping, and that an impossible
grow raises MemoryError leaving the buffer as it was. Prints a table last; exits 1 on any failure.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ft.engine.memory.vmm import VmmBuffer, resize_rows_vmm, vmm_available

MiB = 1 << 20
GiB = 1 << 30
ROWS: list[tuple[str, str, str]] = []  # (check, ok/FAIL, detail)


def record(name: str, ok: bool, detail: str = "") -> bool:
    ROWS.append((name, "ok" if ok else "FAIL", detail))
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return ok


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def pattern(n: int, offset: int = 0) -> torch.Tensor:
    return (torch.arange(n, device="cuda", dtype=torch.int64) * 2654435761 + offset).to(torch.int32)


def main() -> int:
    dev = torch.device("cuda", 0)
    try:
        import cuda.bindings as cb
        cbv = getattr(cb, "__version__", "?")
    except Exception:  # noqa: BLE001
        cbv = "missing"
    print(f"torch {torch.__version__}, cuda-bindings {cbv}, {torch.cuda.get_device_name(0)}", flush=True)
    if not record("vmm_available", vmm_available(dev), str(dev)):
        return 1
    torch.empty(1, device=dev)
    torch.cuda.empty_cache()

    # -- reserve 1 GiB, grow to 100 MiB, fill, capture graphs ----------------------------------
    buf = VmmBuffer(1 * GiB, dev)
    g = buf.granularity
    record("granularity", g > 0, f"{g} B = {g / MiB:g} MiB; reserved {buf.max_bytes / MiB:g} MiB at 0x{buf.ptr:x}")
    base = buf.ptr
    free0 = free_bytes()
    buf.resize(100 * MiB)
    free1 = free_bytes()
    record("grow 0->100 MiB", buf.mapped_bytes == 100 * MiB and buf.ptr == base,
           f"mapped {buf.mapped_bytes / MiB:g} MiB, free fell {(free0 - free1) / MiB:.1f} MiB")

    n100 = 100 * MiB // 4
    t = buf.tensor(torch.int32, (n100,))
    ok_ptr = t.data_ptr() == base and t.device == dev
    xa = t[: 10 * MiB // 4]  # graph A: first 10 MiB (stays mapped throughout)
    yb = t[60 * MiB // 4: 70 * MiB // 4]  # graph B: [60, 70) MiB (unmapped by the shrink, remapped later)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        xa.add_(1)
        yb.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_a):
        xa.add_(1)
    with torch.cuda.graph(graph_b):
        yb.add_(1)
    ref = pattern(n100)
    t.copy_(ref)
    torch.cuda.synchronize()
    record("fill 100 MiB through a torch view", ok_ptr and torch.equal(t, ref), f"view data_ptr==base: {ok_ptr}")

    graph_a.replay()
    torch.cuda.synchronize()
    ref[: xa.numel()] += 1
    record("graph A replay (before shrink)", torch.equal(t, ref))

    # -- shrink to 40 MiB: data kept, free memory rises at once ----------------------------------
    n40 = 40 * MiB // 4
    f_before = free_bytes()
    buf.resize(40 * MiB)
    f_after = torch.cuda.mem_get_info()[0]  # right after, no extra sync
    rise = f_after - f_before
    record("shrink 100->40 MiB frees memory", buf.mapped_bytes == 40 * MiB and abs(rise - 60 * MiB) <= 4 * MiB,
           f"free rose {rise / MiB:.1f} MiB (expect 60)")
    t40 = buf.tensor(torch.int32, (n40,))
    record("kept 40 MiB intact after shrink", t40.data_ptr() == base and torch.equal(t40, ref[:n40]))
    graph_a.replay()
    torch.cuda.synchronize()
    ref[: xa.numel()] += 1
    record("graph A replay after shrink", torch.equal(t40, ref[:n40]))

    # -- regrow to 300 MiB: base unchanged, old data intact, graph B over remapped memory ---------
    f_before = free_bytes()
    buf.resize(300 * MiB)
    f_after = free_bytes()
    n300 = 300 * MiB // 4
    t300 = buf.tensor(torch.int32, (n300,))
    record("regrow 40->300 MiB", buf.ptr == base and t300.data_ptr() == base and buf.mapped_bytes == 300 * MiB,
           f"base unchanged: {buf.ptr == base}; free fell {(f_before - f_after) / MiB:.1f} MiB (expect 260)")
    record("old 40 MiB intact after regrow", torch.equal(t300[:n40], ref[:n40]))
    ref300 = torch.empty(n300, dtype=torch.int32, device=dev)
    ref300[:n40] = ref[:n40]
    ref300[n40:] = pattern(n300 - n40, offset=12345)
    t300[n40:] = ref300[n40:]
    graph_b.replay()
    graph_a.replay()
    torch.cuda.synchronize()
    ref300[60 * MiB // 4: 70 * MiB // 4] += 1
    ref300[: xa.numel()] += 1
    record("graphs A+B replay after shrink+regrow", torch.equal(t300, ref300),
           "B covers [60,70) MiB, unmapped then remapped")
    del t, xa, yb, t40, graph_a, graph_b

    # -- timing: map 50 chunks, unmap 10 chunks ------------------------------------------------
    start = buf.mapped_bytes
    maps, unmaps = [], []
    for _ in range(7):
        buf.resize(start)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buf.resize(start + 50 * g)
        t1 = time.perf_counter()
        buf.resize(start + 40 * g)
        t2 = time.perf_counter()
        maps.append(t1 - t0)
        unmaps.append(t2 - t1)
    buf.resize(start)
    mm, um = statistics.median(maps) * 1e3, statistics.median(unmaps) * 1e3
    record("time map 50 chunks", True, f"median {mm:.2f} ms ({mm / 50 * 1e3:.0f} us/chunk, {50 * g / MiB:g} MiB), 7 reps")
    record("time unmap 10 chunks", True, f"median {um:.2f} ms ({um / 10 * 1e3:.0f} us/chunk, incl. device sync), 7 reps")

    # -- resize_rows_vmm ------------------------------------------------------------------------
    rb = VmmBuffer(64 * MiB, dev)
    r = rb.tensor(torch.bfloat16, (0, 8, 128))
    r = resize_rows_vmm(rb, r, 100)
    r.copy_(torch.randn(100, 8, 128, device=dev).to(torch.bfloat16))
    keep = r.clone()
    r2 = resize_rows_vmm(rb, r, 5000)
    ok = r2.shape == (5000, 8, 128) and r2.data_ptr() == rb.ptr and torch.equal(r2[:100], keep)
    r2[100:].fill_(3)
    r3 = resize_rows_vmm(rb, r2, 50)
    ok = ok and r3.data_ptr() == rb.ptr and torch.equal(r3, keep[:50]) and rb.mapped_bytes == g
    try:
        rb.resize(65 * MiB)
        ok = False
    except ValueError:
        pass
    record("resize_rows_vmm grow/shrink", ok, f"rows 100->5000->50 bf16[8,128], mapped {rb.mapped_bytes / MiB:g} MiB")
    del r, r2, r3
    rb.close()

    # -- close frees everything ------------------------------------------------------------------
    f_before = free_bytes()
    mapped = buf.mapped_bytes
    buf.close()
    buf.close()  # idempotent
    f_after = torch.cuda.mem_get_info()[0]
    record("close frees all (twice is fine)", abs((f_after - f_before) - mapped) <= 4 * MiB and buf.closed,
           f"free rose {(f_after - f_before) / MiB:.1f} MiB (expect {mapped / MiB:g})")

    # -- a grow that must fail -------------------------------------------------------------------
    torch.cuda.empty_cache()
    big = VmmBuffer(200 * GiB, dev)
    big.resize(20 * MiB)
    tb = big.tensor(torch.int32, (20 * MiB // 4,))
    refb = pattern(tb.numel(), offset=7)
    tb.copy_(refb)
    f_before = free_bytes()
    t0 = time.perf_counter()
    err = None
    try:
        big.resize(160 * GiB)
    except MemoryError as e:
        err = e
    dt = time.perf_counter() - t0
    f_after = free_bytes()
    ok = (err is not None and big.mapped_bytes == 20 * MiB and abs(f_after - f_before) <= 4 * MiB
          and torch.equal(tb, refb))
    record("grow to 160 GiB fails cleanly", ok,
           f"{type(err).__name__ if err else 'no error'} in {dt:.2f} s; mapped {big.mapped_bytes / MiB:g} MiB; "
           f"free changed {(f_after - f_before) / MiB:+.1f} MiB")
    if err is not None:
        print(f"    message: {err}", flush=True)
    del tb
    big.close()
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        record("unexpected exception", False, traceback.format_exc().strip().splitlines()[-1])
        rc = 1
    w = max((len(r[0]) for r in ROWS), default=10)
    print()
    print("| " + "check".ljust(w) + " | result | detail |")
    print("|" + "-" * (w + 2) + "|--------|--------|")
    for name, res, detail in ROWS:
        print(f"| {name.ljust(w)} | {res:6} | {detail} |")
    if any(r[1] == "FAIL" for r in ROWS):
        rc = 1
    print(f"exit {rc}")
    sys.exit(rc)
