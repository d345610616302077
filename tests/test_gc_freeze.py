"""`ft.server.gc_freeze`: the startup heap frozen out of the cyclic collector's reach."""

from __future__ import annotations

import gc
import weakref

from ft.server.gc_freeze import freeze_startup_heap


class _Node:
    pass


def test_freeze_collects_garbage_first_then_freezes_what_lives():
    dead = _Node()
    dead.me = dead  # a cycle: only the cyclic collector frees it
    dead_ref = weakref.ref(dead)
    del dead
    alive = _Node()
    alive.me = alive
    try:
        frozen = freeze_startup_heap()
        assert dead_ref() is None  # collected, not made permanent
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # out of every generation the collector walks
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())


def test_serve_freezes_by_default_and_takes_no_gc_freeze():
    from ft.cli import build_parser

    parser = build_parser("serve")
    assert parser.parse_args(["serve"]).gc_freeze is True
    assert parser.parse_args(["serve", "--no-gc-freeze"]).gc_freeze is False
