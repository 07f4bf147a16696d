"""The Pipeline keeps mitmproxy's addon guarantees while dispatching tether's addons as one entry.

Driven through a real mitmproxy AddonManager (``taddons``), with small recording addons: order, an
exception isolated to its addon, an awaitable (an approval hold) awaited before the next addon runs,
and a hook the pipeline would not relay refused at construction.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.test import taddons, tflow

from tether.proxy.pipeline import Pipeline


class Recorder:
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def request(self, flow: Any) -> None:
        self.seen.append(f"{self.name}.request")

    def response(self, flow: Any) -> None:
        self.seen.append(f"{self.name}.response")


class Failing(Recorder):
    def request(self, flow: Any) -> None:
        self.seen.append(f"{self.name}.request")
        raise RuntimeError("boom")


class Holding(Recorder):
    def __init__(self, name: str, seen: list[str], release: asyncio.Event) -> None:
        super().__init__(name, seen)
        self.release = release

    def request(self, flow: Any) -> Any:
        self.seen.append(f"{self.name}.held")

        async def hold() -> None:
            await self.release.wait()
            self.seen.append(f"{self.name}.released")

        return hold()


async def test_addons_run_in_order_each_hook() -> None:
    seen: list[str] = []
    pipeline = Pipeline([Recorder("a", seen), Recorder("b", seen), Recorder("c", seen)])
    flow = tflow.tflow(resp=True)
    with taddons.context(pipeline) as tctx:
        await tctx.master.addons.handle_lifecycle(HttpRequestHook(flow))
        await tctx.master.addons.handle_lifecycle(HttpResponseHook(flow))
    assert seen == ["a.request", "b.request", "c.request", "a.response", "b.response", "c.response"]


async def test_an_exception_is_logged_and_the_next_addon_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    pipeline = Pipeline([Recorder("a", seen), Failing("bad", seen), Recorder("c", seen)])
    with taddons.context(pipeline) as tctx, caplog.at_level(logging.ERROR, "tether.sidecar"):
        await tctx.master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    assert seen == ["a.request", "bad.request", "c.request"]
    assert any("boom" in (r.exc_text or "") for r in caplog.records)


async def test_a_held_call_is_awaited_before_the_next_addon_runs() -> None:
    seen: list[str] = []
    release = asyncio.Event()
    pipeline = Pipeline([Recorder("a", seen), Holding("hold", seen, release), Recorder("c", seen)])
    with taddons.context(pipeline) as tctx:
        task = asyncio.create_task(tctx.master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow())))
        await asyncio.sleep(0.05)
        assert seen == ["a.request", "hold.held"]  # c waits for the hold
        release.set()
        await asyncio.wait_for(task, 5)
    assert seen == ["a.request", "hold.held", "hold.released", "c.request"]


def test_a_hook_the_pipeline_does_not_relay_is_refused() -> None:
    class Watches:
        def server_connected(self, data: Any) -> None: ...

    with pytest.raises(TypeError, match="server_connected"):
        Pipeline([Watches()])


def test_without_a_handler_a_hook_costs_nothing() -> None:
    pipeline = Pipeline([Recorder("a", [])])
    assert pipeline.error(tflow.tflow(err=True)) is None
