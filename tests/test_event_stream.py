"""The streaming event channel (``GET /v1/events/stream``) end to end, with real parts: two control plane
replicas over a real ``redis-server`` this module starts, the sidecar's own stream client
(``ControlChannel.stream_events``), and a real sidecar process on an embedded store.

What a user relies on: a revocation made on one replica reaches a sidecar streaming from the other, and
only the sidecars whose chain it cuts; a sidecar whose connection dropped resumes from its last sequence
number (on either replica) and misses nothing; one too far behind gets the long poll's resync document;
a running sidecar follows the stream, and a revocation reaches it over it.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.proxy.channel import ControlChannel

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import ControlPlaneProcess, Identity, RedisServer, SidecarProcess, prepare_controlplane, wait_until

LIVENESS_S = 8.0  # under the stream's 10 s keepalive: only the event itself can arrive in time


@dataclass
class Pair:
    a: ControlPlaneProcess
    b: ControlPlaneProcess


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("stream")
    redis = RedisServer(directory / "redis").start()
    a = prepare_controlplane(directory / "a", 1, 2, 3, store=redis.url(0))
    b = ControlPlaneProcess(directory / "b", store=redis.url(0))
    b.directory.mkdir(parents=True)
    for path in (a.catalog_path, a.signing_key_path):  # one deployment: the same catalog and key
        shutil.copy(path, b.directory / path.name)
    try:
        a.start()
        b.start()
        yield Pair(a, b)
    finally:
        a.stop()
        b.stop()
        redis.stop()


def channel(cp: ControlPlaneProcess, ident: Identity) -> ControlChannel:
    leaf = parse_chain_unverified(ident.wire)[-1].hash
    return ControlChannel(cp.url, ident.agent, leaf, keys.load_private(ident.key_path.read_bytes()),
                          run=f"run-{leaf[7:19]}")


def registered(cp: ControlPlaneProcess, ident: Identity) -> Identity:
    async def go() -> None:
        ch = channel(cp, ident)
        try:
            await ch.register(ident.wire)
        finally:
            await ch.close()

    asyncio.run(go())
    return ident


class Follower:
    """A sidecar's stream client collecting every document it reads, in a background task."""

    def __init__(self, cp: ControlPlaneProcess, ident: Identity, after: int = -1) -> None:
        self.ch = channel(cp, ident)
        self.docs: list[dict[str, Any]] = []
        self.task = asyncio.create_task(self._run(after))

    async def _run(self, after: int) -> None:
        async for doc in self.ch.stream_events(after):
            self.docs.append(doc)

    def revoked(self) -> list[str]:
        return [e["payload"]["jti"] for d in self.docs for e in d.get("events", []) if e["kind"] == "revoke"]

    async def until(self, predicate: Any, what: str) -> None:
        deadline = time.monotonic() + LIVENESS_S
        while not predicate():
            if self.task.done():
                raise AssertionError(f"the stream ended: {self.task.exception()!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {LIVENESS_S}s; read {self.docs}")
            await asyncio.sleep(0.02)

    async def drop(self) -> int:
        """Drop the connection, as a network failure would; returns the last sequence number read."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.ch.close()
        return int(self.docs[-1]["next"])


def open_streams(cp: ControlPlaneProcess) -> int:
    with urllib.request.urlopen(cp.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return int(re.search(r"^tether_event_streams_open (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]


def test_a_revocation_on_a_reaches_only_the_streams_it_cuts_on_b(pair: Pair) -> None:
    root = registered(pair.a, pair.a.issue("st-root", {"issues.read": "direct"}))
    child = registered(pair.a, pair.a.delegate(root, "st-child", {"issues.read": "direct"}))
    grandchild = registered(pair.a, pair.a.delegate(child, "st-grandchild", {"issues.read": "direct"}))
    other = registered(pair.a, pair.a.issue("st-other", {"issues.read": "direct"}))

    async def go() -> dict[str, Any]:
        cut = Follower(pair.b, grandchild)
        spared = Follower(pair.b, other)
        for f in (cut, spared):
            await f.until(lambda f=f: f.docs, "opening line")
        assert cut.docs[0]["resync"] is True and cut.docs[0]["revoked"] == []  # asked from -1: a full resync
        answer = await asyncio.to_thread(pair.a.client().request, "POST", f"/v1/grants/{child.jti}/revoke", {})
        await cut.until(lambda: cut.revoked(), "revocation")
        assert cut.revoked() == [child.jti]
        event = next(e for d in cut.docs for e in d.get("events", []))
        assert cut.docs[-1]["next"] == event["seq"]
        # the other stream got nothing but its opening line (the revocation is not its chain's)
        await asyncio.sleep(0.3)
        assert spared.revoked() == [] and all(not d.get("events") for d in spared.docs)
        assert open_streams(pair.b) >= 2
        for f in (cut, spared):
            await f.drop()
        return answer

    answer = asyncio.run(go())
    assert sorted(answer["agents_cut_off"]) == ["st-child", "st-grandchild"]  # from the descendants index


def test_a_dropped_stream_resumes_by_sequence_number_on_either_replica(pair: Pair) -> None:
    ident = registered(pair.a, pair.a.issue("rs-agent", {"issues.read": "direct"}))
    later = registered(pair.a, pair.a.delegate(ident, "rs-later", {"issues.read": "direct"}))

    async def go() -> None:
        first = Follower(pair.b, later)
        await first.until(lambda: first.docs, "opening line")
        seq = await first.drop()
        # while it is away: its chain is revoked (the root), and another chain's event is appended
        unrelated = await asyncio.to_thread(registered, pair.a, pair.a.issue("rs-unrelated", {"issues.read": "direct"}))
        await asyncio.to_thread(pair.a.client().request, "POST", f"/v1/grants/{unrelated.jti}/revoke", {})
        await asyncio.to_thread(pair.a.client().request, "POST", f"/v1/grants/{ident.jti}/revoke", {})
        # resumed on the other replica from where it was: exactly the missed revocation of its own chain
        resumed = Follower(pair.a, later, after=seq)
        await resumed.until(lambda: resumed.docs, "opening line")
        assert "resync" not in resumed.docs[0]
        assert resumed.revoked() == [ident.jti]
        assert resumed.docs[0]["next"] > seq
        head = await resumed.drop()
        # from a sequence the log cannot have: the long poll's resync document, with the revocation in it
        stale = Follower(pair.b, later, after=head + 10_000)
        await stale.until(lambda: stale.docs, "resync")
        assert stale.docs[0]["resync"] is True and stale.docs[0]["revoked"] == [ident.jti]
        assert stale.docs[0]["events"] == [] and stale.docs[0]["next"] >= head
        await stale.drop()

    asyncio.run(go())


def test_the_stream_refuses_unsigned_and_unregistered_callers(pair: Pair) -> None:
    assert requests.get(pair.b.url + "/v1/events/stream?after=0", timeout=5).status_code == 401
    stranger = pair.a.issue("st-stranger", {"issues.read": "direct"})  # never registered

    async def go() -> str:
        ch = channel(pair.b, stranger)
        try:
            async for _doc in ch.stream_events(0):
                return "streamed"
        except Exception as exc:
            return getattr(exc, "code", repr(exc))
        finally:
            await ch.close()
        return "ended"

    assert asyncio.run(go()) == "tether.unauthorized"


# -- a real sidecar ---------------------------------------------------------------------------------------------
@pytest.fixture
def slow_heartbeat_world(tmp_path: Path, test_ca: harness.TestCA) -> Iterator[World]:
    """Heartbeats every 10 s (lease 30 s): a revocation that arrives sooner came over the event stream."""
    w = build_world(tmp_path, test_ca, lease_ttl=30.0)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


def test_a_running_sidecar_follows_the_stream_and_a_revocation_reaches_it(slow_heartbeat_world: World,
                                                                        test_ca: harness.TestCA) -> None:
    w = slow_heartbeat_world
    ident = w.cp.issue("live", {"issues.read": "direct"})
    sidecar = SidecarProcess(w.cp, ident).start(test_ca.ca_pem)
    w.sidecars.append(sidecar)
    wait_until(lambda: open_streams(w.cp) == 1, 10, what="the sidecar's event stream")
    url = f"{w.tools.base}/repos/o/r/issues"
    assert requests.get(url, proxies=sidecar.proxies(), timeout=10).status_code == 200
    w.cp.client().request("POST", f"/v1/grants/{ident.jti}/revoke", {})

    def refused() -> bool:
        resp = requests.get(url, proxies=sidecar.proxies(), timeout=10)
        return resp.headers.get("Tether-Error") == "tether.chain_revoked"

    wait_until(refused, LIVENESS_S, what="the revocation to reach the sidecar")
    assert f"revoked: {ident.jti}" in sidecar.log_text  # from the stream, not "(learned from the heartbeat)"
