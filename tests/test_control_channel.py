"""The shared-memory control channel (`ft.parallel.control_channel`) in one process: a writer and
two readers on threads, messages split into parts, acknowledgements, a reader that never reads."""

from __future__ import annotations

import os
import threading

import pytest

from ft.parallel.control_channel import PAYLOAD_OFFSET, ControlChannel


def _open(path: str, readers: int, size: int, timeout_s: float = 30.0):
    w = ControlChannel(path, 0, readers, True, timeout_s, size=size)
    rs = [ControlChannel(path, r, readers, False, timeout_s, size=size) for r in range(1, readers + 1)]
    w.unlink()
    return w, rs


def test_messages_arrive_in_order_whole_and_in_parts(tmp_path):
    size = PAYLOAD_OFFSET + 256  # messages of several parts
    w, rs = _open(str(tmp_path / "ch"), 2, size)
    msgs = [("step", list(range(n))) for n in (0, 3, 200, 1000)] + [None, b"x" * 255, "y" * 5000]
    got: dict[int, list] = {1: [], 2: []}

    def read(r: ControlChannel) -> None:
        for _ in msgs:
            got[r.rank].append(r.recv())

    threads = [threading.Thread(target=read, args=(r,)) for r in rs]
    for t in threads:
        t.start()
    for m in msgs:
        w.send(m)
    for t in threads:
        t.join(30)
    assert got[1] == msgs and got[2] == msgs
    assert not os.path.exists(tmp_path / "ch")  # unlinked once mapped: nothing left behind


def test_writer_waits_for_every_reader_and_says_which_is_slow(tmp_path):
    w, rs = _open(str(tmp_path / "ch"), 2, PAYLOAD_OFFSET + 64, timeout_s=0.3)
    w.send("first")  # fits: nobody has to have read anything yet
    assert rs[0].recv() == "first"
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] did not take a control message"):
        w.send("second")  # rank 2 never read the first: the buffer may not be overwritten


def test_a_stale_file_is_refused_by_a_second_writer(tmp_path):
    path = str(tmp_path / "ch")
    ControlChannel(path, 0, 1, True, 1.0, size=PAYLOAD_OFFSET + 64)
    with pytest.raises(FileExistsError):
        ControlChannel(path, 0, 1, True, 1.0, size=PAYLOAD_OFFSET + 64)


def test_a_reader_past_its_polling_time_still_takes_the_message(tmp_path):
    """A worker of an idle server backs off to sleeps and waits as long as rank 0 lives (no
    timeout: a gloo broadcast would fail after its timeout)."""
    import time

    from ft.parallel import control_channel

    w, (r,) = _open(str(tmp_path / "ch"), 1, PAYLOAD_OFFSET + 64)
    got = []
    t = threading.Thread(target=lambda: got.append(r.recv()))
    t.start()
    time.sleep(control_channel.SPIN_S + 0.3)
    w.send(("step", 1))
    t.join(10)
    assert got == [("step", 1)]


def test_writer_stops_waiting_for_a_reader_whose_process_exited(tmp_path):
    w, rs = _open(str(tmp_path / "ch"), 1, PAYLOAD_OFFSET + 64, timeout_s=60.0)
    w.readers_alive = lambda: False
    w.send("first")
    with pytest.raises(RuntimeError, match="exited before it took a control message"):
        w.send("second")  # well before the 60 s timeout
