"""`ft top` driven by Textual's Pilot against a real `ft serve` (the small checkpoint of conftest.py,
ladder on, 256-token step): `+` moves the server one rung up, `a` toggles auto, the resize dialog
refuses an out-of-range target without asking the server to resize and applies an in-range one.
Every effect is checked through the admin API itself; every wait polls a condition."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_proc import WAIT_S, ServerProcess

from ft.ctl.client import AdminClient
from ft.tui.app import make_app


@pytest.fixture(scope="module")
def server(serve_checkpoint):
    srv = ServerProcess("--model", str(serve_checkpoint), "--enable-kv-ladder", "--ladder-step-size", "256",
                        "--ladder-dwell-s", "0", "--ladder-grow-hold-s", "0")
    yield srv
    srv.stop()


class CountingClient(AdminClient):
    """An AdminClient that records every resize that is not a dry run."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.applied: list[dict] = []

    def resize(self, moe=None, kv=None, mamba=None, wait_s=None, dry_run=False):
        if not dry_run:
            self.applied.append({"moe": moe, "kv": kv, "mamba": mamba})
        return super().resize(moe=moe, kv=kv, mamba=mamba, wait_s=wait_s, dry_run=dry_run)


def admin(server) -> dict:
    return server.get("/admin/cache").json()


def history_len(server) -> int:
    return len(server.get("/admin/cache/history").json()["entries"])


async def until(pilot, cond, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.1)


def test_keys_drive_the_server(server):
    client = CountingClient(server.url, timeout=WAIT_S)
    app = make_app(server.url, None, 0.5, client=client)
    notes: list[dict] = []
    notify = app.notify
    app.notify = lambda message, **kw: notes.append(kw) or notify(message, **kw)  # widgets' notify calls this

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.cache is not None and app.cache.state == "serving")
            start = admin(server)
            rung, rungs = start["ladder"]["current"], start["ladder"]["rungs"]

            await pilot.press("plus")  # one rung up
            await until(pilot, lambda: admin(server)["ladder"]["current"] == rung + 1)
            assert admin(server)["pools"]["kv"]["size"] == rungs[rung + 1]
            await until(pilot, lambda: app.busy is None)

            auto = admin(server)["ladder"]["auto"]
            await pilot.press("a")
            await until(pilot, lambda: admin(server)["ladder"]["auto"] is (not auto))
            await until(pilot, lambda: app.busy is None and app.cache.ladder.auto is (not auto))
            await pilot.press("a")
            await until(pilot, lambda: admin(server)["ladder"]["auto"] is auto)
            await until(pilot, lambda: app.cache.ladder.auto is auto)

            # out of range: refused in the dialog, the server never asked to resize
            before = history_len(server)
            await pilot.press("r")
            await until(pilot, lambda: type(app.screen).__name__ == "ResizeScreen")
            app.screen.query_one("#target-kv").value = "999999"
            await pilot.press("enter")
            await until(pilot, lambda: any(n.get("title") == "refused" for n in notes))  # Enter was handled
            assert client.applied == [] and history_len(server) == before
            assert type(app.screen).__name__ == "ResizeScreen"  # still open, showing why

            # the ranges follow the other fields: with KV at its minimum, mamba's range reaches further
            st = admin(server)
            app.screen.query_one("#target-kv").value = str(st["pools"]["kv"]["min"])

            def range_hi(name: str) -> int:
                return int(str(app.screen.query_one(f"#range-{name}").render()).split("..")[-1])

            await until(pilot, lambda: range_hi("mamba") > st["pools"]["mamba"]["max"])

            # in range: applied on Enter
            kv = admin(server)["pools"]["kv"]
            target = max(kv["min"], kv["size"] - 256)
            app.screen.query_one("#target-kv").value = str(target)
            await pilot.press("enter")
            await until(pilot, lambda: admin(server)["pools"]["kv"]["size"] == target)
            assert client.applied == [{"moe": None, "kv": target, "mamba": None}]
            assert history_len(server) == before + 1
            await until(pilot, lambda: app.busy is None)
            await pilot.press("q")

    asyncio.run(scenario())
    client.close()
