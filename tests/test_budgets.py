"""Budgets owned by the root, with real processes: control planes (SQLite, and two replicas on a real Redis),
mitmproxy sidecars and an aiohttp tool server. A root with ``calls=20`` delegates a child ``calls=15``; both
call as fast as they can from separate sidecars. What a user relies on: the tool server sees exactly the
budget, the child never more than its own, every other call is refused 429 ``tether.budget_exhausted``, and
a sidecar killed holding a slice never lets the total exceed the budget, and a slice whose answer never reached
its sidecar (a link that loses it; a replica crashing between the take and the answer) goes back to the budget.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from aiohttp import web

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import ControlPlaneProcess, Identity, RedisServer, SidecarProcess, close_loop, free_port, wait_until

ISSUES = "/repos/o/r/issues"
REDIS_LEASE_S = 45.0  # the two-replica fixture's lease TTL (its sidecars heartbeat every 15 s)
QUIET_S = 1.0  # a caller stops once every call has been refused this long (refusals are remembered 0.25 s)


def budgeted(calls: int | None = None, per_minute: int | None = None) -> dict:
    grant: dict = {"tier": "direct"}
    if calls is not None:
        grant["calls"] = calls
    if per_minute is not None:
        grant["per_minute"] = per_minute
    return {"issues.read": grant}


class Caller(threading.Thread):
    """Calls through one sidecar as fast as it can until its calls have been refused for QUIET_S."""

    def __init__(self, world: World, sidecar: SidecarProcess, limit_s: float = 60.0, quiet_s: float = QUIET_S) -> None:
        super().__init__(daemon=True)
        self.url = f"{world.tools.base}{ISSUES}"
        self.sidecar = sidecar
        self.limit_s = limit_s
        self.quiet_s = quiet_s
        self.outcomes: Counter[str] = Counter()
        self.times: list[float] = []  # when each forwarded call's answer came back
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            session = requests.Session()
            session.trust_env = False
            refused_since: float | None = None
            deadline = time.monotonic() + self.limit_s
            while time.monotonic() < deadline:
                resp = session.get(self.url, proxies=self.sidecar.proxies(), timeout=15)
                now = time.monotonic()
                if resp.status_code == 200:
                    self.outcomes["forwarded"] += 1
                    self.times.append(time.time())
                    refused_since = None
                    continue
                self.outcomes[f"{resp.status_code} {resp.headers.get('Tether-Error')}"] += 1
                refused_since = refused_since or now
                if now - refused_since >= self.quiet_s:
                    return
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.error = exc


def run_callers(*callers: Caller) -> None:
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(120)
        assert caller.error is None, caller.error
        assert not caller.is_alive()


def budget_view(cp: ControlPlaneProcess, jti: str) -> dict:
    return cp.client().request("GET", f"/v1/budgets/{jti}")["links"][0]


def only_budget_refusals(*callers: Caller, code: str = "tether.budget_exhausted") -> None:
    for caller in callers:
        refusals = {k: v for k, v in caller.outcomes.items() if k != "forwarded"}
        assert set(refusals) == {f"429 {code}"}, caller.outcomes


def root_and_child(cp: ControlPlaneProcess) -> tuple[Identity, Identity]:
    root = cp.issue("root", budgeted(calls=20))
    child = cp.delegate(root, "child", budgeted(calls=15))
    return root, child


# -- one control plane (SQLite) ----------------------------------------------------------------------------
def test_subtree_budget_is_shared_and_never_exceeded(world: World) -> None:
    root, child = root_and_child(world.cp)
    root_car, child_car = world.sidecar(root), world.sidecar(child)
    a, b = Caller(world, root_car), Caller(world, child_car)
    run_callers(a, b)

    assert world.tools.hits_for(ISSUES) == 20  # the root's budget, exactly: used, not stranded
    assert a.outcomes["forwarded"] + b.outcomes["forwarded"] == 20
    assert b.outcomes["forwarded"] <= 15
    only_budget_refusals(a, b)

    # The tree: the root's budget counts both, the child's only its own; stopping returns what was leased.
    root_car.stop()
    child_car.stop()
    view = budget_view(world.cp, root.jti)
    assert view["agent"] == "root" and view["children"][0]["agent"] == "child"
    assert view["budgets"]["issues.read"] == {"tier": "direct", "granted": 20, "used": 20, "leased": 0, "left": 0}
    child_budget = view["children"][0]["budgets"]["issues.read"]
    assert child_budget["granted"] == 15 and child_budget["used"] == b.outcomes["forwarded"]
    assert child_budget["leased"] == 0


def test_a_sidecar_killed_holding_a_slice_never_lets_the_total_exceed_the_budget(world: World) -> None:
    root, child = root_and_child(world.cp)
    child_car = world.sidecar(child)
    session = requests.Session()
    session.trust_env = False
    for _ in range(6):  # slices grow with use: the child now holds units it has not spent
        assert session.get(f"{world.tools.base}{ISSUES}", proxies=child_car.proxies(), timeout=10).status_code == 200
    child_car.kill()
    held = budget_view(world.cp, root.jti)["budgets"]["issues.read"]
    assert held["leased"] > 0, held  # the slice died with the sidecar

    a = Caller(world, world.sidecar(root))
    run_callers(a)
    assert world.tools.hits_for(ISSUES) == 6 + a.outcomes["forwarded"] <= 20
    only_budget_refusals(a)
    # Once the dead run's lease lapses, its slice is counted as spent (fail closed), never handed out again.
    after = wait_until(lambda: (v := budget_view(world.cp, root.jti)["budgets"]["issues.read"])["leased"] == 0 and v,
                       20, what="the dead sidecar's slice settled as spent")
    assert after["used"] == 20 and after["left"] == 0  # what the dead sidecar held counts: fail closed


def test_per_minute_refuses_rate_limited_within_each_window(tmp_path: Path, test_ca: harness.TestCA,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    window = 2.0
    monkeypatch.setenv("TETHER_RATE_WINDOW_S", str(window))  # the control plane counts in 2 s windows
    world = build_world(tmp_path, test_ca)
    world.cp.start()
    try:
        root = world.cp.issue("root", budgeted(per_minute=5))
        child = world.cp.delegate(root, "child", budgeted(per_minute=3))
        # Refused for a whole window is not "done": the next window lets calls through again.
        a = Caller(world, world.sidecar(root), limit_s=5.0, quiet_s=window + 1.0)
        b = Caller(world, world.sidecar(child), limit_s=5.0, quiet_s=window + 1.0)
        started = time.time()
        run_callers(a, b)
        ended = time.time()
        windows = int(ended // window) - int(started // window) + 1
        forwarded = sorted(a.times + b.times)
        assert len(forwarded) <= 5 * windows  # the root's rate bounds the subtree
        assert len(b.times) <= 3 * windows
        assert len(forwarded) > 5  # a rate, not a budget: each new window lets calls through again
        only_budget_refusals(a, b, code="tether.rate_limited")
    finally:
        teardown_world(world)


SESSION = web.AppKey("session", aiohttp.ClientSession)


class LossyLink:
    """A link between a sidecar and its control plane that passes everything through, byte for byte (the
    proof signs the path and body, not the address), except that it loses the answers to the slice requests
    it is told to: the control plane took the slice, the sidecar never hears of it (what a replica crashing
    between the two does)."""

    def __init__(self, upstream: str, lose: set[int]) -> None:
        self.upstream = upstream.rstrip("/")
        self.lose = lose  # which slice requests (1, 2, ...) lose their answer
        self.slice_requests = 0
        self.lost = 0
        self.port = free_port()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        session = request.app[SESSION]
        number = 0
        if request.method == "POST" and request.path == "/v1/budgets/slices":
            self.slice_requests += 1
            number = self.slice_requests
        # The body as the control plane reads it: aiohttp's server decompressed it already.
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "content-encoding", "transfer-encoding")}
        async with session.request(request.method, self.upstream + request.path_qs, data=await request.read(),
                                   headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as upstream:
            if number in self.lose:
                await upstream.read()  # the control plane answered: the slice is taken
                self.lost += 1
                assert request.transport is not None
                request.transport.abort()  # ... and the answer never arrives
                raise ConnectionResetError("the answer is lost on its way")
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding")})  # still compressed, if it was
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # the event stream too, as it comes
                await response.write(chunk)
            await response.write_eof()
            return response

    def start(self) -> LossyLink:
        ready = threading.Event()

        async def session_ctx(app: web.Application) -> Any:
            app[SESSION] = aiohttp.ClientSession(auto_decompress=False)
            yield
            await app[SESSION].close()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.cleanup_ctx.append(session_ctx)
            app.router.add_route("*", "/{tail:.*}", self._relay)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(runner.cleanup())
                close_loop(loop)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10), "the lossy link did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)


def test_a_slice_whose_answer_was_lost_goes_back_to_the_budget(world: World) -> None:
    """The control plane takes a slice and its answer never reaches the sidecar (here a link that loses it;
    in life a replica that crashed between the two). The sidecar's next heartbeat does not hold it, so the
    sweep returns it: the tool sees the whole budget, never more, with the sidecar still running."""
    root = world.cp.issue("root", budgeted(calls=20))
    link = LossyLink(world.cp.url, lose={2, 4}).start()  # the 2nd and 4th slices: taken, never received
    try:
        car = world.sidecar(root, "--controlplane", link.url)  # the last --controlplane is the one it uses
        caller = Caller(world, car)
        run_callers(caller)
        deadline = time.monotonic() + 90
        while caller.outcomes["forwarded"] < 20 and time.monotonic() < deadline:
            again = Caller(world, car)  # the lost slices come back within a heartbeat or two: call again
            run_callers(again)
            caller.outcomes.update(again.outcomes)
        assert link.lost == 2
        assert world.tools.hits_for(ISSUES) == caller.outcomes["forwarded"] == 20, caller.outcomes
        only_budget_refusals(caller)
        view = budget_view(world.cp, root.jti)["budgets"]["issues.read"]
        assert view["used"] + view["leased"] == 20 and view["left"] == 0
        log = (world.cp.directory / "controlplane.log").read_text(errors="replace")
        assert log.count("never reached it (its heartbeat does not hold it); returned to the budget") == 2, log[-3000:]
        car.stop()
        after = budget_view(world.cp, root.jti)["budgets"]["issues.read"]
        assert (after["used"], after["leased"], after["left"]) == (20, 0, 0)
    finally:
        link.stop()


# -- two replicas on Redis, one killed mid-run ---------------------------------------------------------------
@pytest.fixture
def redis_world(tmp_path: Path, test_ca: harness.TestCA) -> Iterator[tuple[World, ControlPlaneProcess]]:
    redis = RedisServer(tmp_path / "redis").start()
    store = redis.url(0)
    # A lease well past the longest restart the harness waits for (20 s): on a loaded machine replica A takes
    # 10 s and more to come back, and a run whose lease lapses meanwhile is refused (tether.lease_expired) and
    # its slices counted spent (fail closed) — a different rule from the one this fixture's test is about.
    world = build_world(tmp_path, test_ca, store=store, lease_ttl=REDIS_LEASE_S)
    b = ControlPlaneProcess(tmp_path / "cp-b", store=store, lease_ttl=REDIS_LEASE_S, grace=world.cp.grace)
    b.directory.mkdir(parents=True)
    for path in (world.cp.catalog_path, world.cp.signing_key_path):  # one deployment: same catalog, same key
        shutil.copy(path, b.directory / path.name)
    try:
        world.cp.start()
        b.start()
        yield world, b
    finally:
        b.stop()
        teardown_world(world)
        redis.stop()


def test_two_replicas_on_redis_share_the_budget_through_a_replica_crash(
        redis_world: tuple[World, ControlPlaneProcess]) -> None:
    world, b = redis_world
    root, child = root_and_child(world.cp)
    root_car = world.sidecar(root)  # follows replica A
    child_car = SidecarProcess(b, child)  # follows replica B
    world.sidecars.append(child_car)
    child_car.start(world.ca.ca_pem)
    a_caller, b_caller = Caller(world, root_car), Caller(world, child_car)
    a_caller.start()
    b_caller.start()
    wait_until(lambda: world.tools.hits_for(ISSUES) >= 4, 30, what="calls under way")
    world.cp.kill()  # replica A dies mid-run; its sidecar's next slice needs it back
    down = time.monotonic()
    world.cp.start()  # a restart on the same Redis: no count lost
    print(f"replica A was down {time.monotonic() - down:.1f}s")  # shown when the test fails: the machine's load
    for caller in (a_caller, b_caller):
        caller.join(120)
        assert caller.error is None, caller.error
    deadline = time.monotonic() + 150  # a slice the crash kept from its sidecar comes back at its next heartbeat
    while time.monotonic() < deadline:
        if a_caller.outcomes["forwarded"] + b_caller.outcomes["forwarded"] >= 20:
            break
        # A caller may have given up while replica A was down (its calls refused for lack of a slice), or
        # while the other sidecar still held units of a slice: both call again, so what either leased is
        # spent, not left stranded (a held slice is the holder's to spend or return, never another's). On a
        # loaded machine that can take more rounds than on a quiet one: call again until the deadline.
        again_a, again_b = Caller(world, root_car), Caller(world, child_car)
        run_callers(again_a, again_b)
        a_caller.outcomes.update(again_a.outcomes)
        b_caller.outcomes.update(again_b.outcomes)
    hits = world.tools.hits_for(ISSUES)
    forwarded = a_caller.outcomes["forwarded"] + b_caller.outcomes["forwarded"]
    # Safety, always: never more than the budget, every call the tool saw was answered through a sidecar, and
    # nothing of the budget is left to take (what is not used is leased).
    assert hits <= 20 and forwarded == hits
    assert b_caller.outcomes["forwarded"] <= 15
    view = budget_view(b, root.jti)["budgets"]["issues.read"]
    assert view["used"] + view["leased"] == 20 and view["left"] == 0
    # Liveness: the whole budget is delivered. A slice whose answer the crash lost is one the root's sidecar
    # gave up on; its next heartbeat does not hold it and the sweep returns it to the budget.
    assert hits == 20, (view, a_caller.outcomes, b_caller.outcomes)
    for caller in (a_caller, b_caller):
        assert all(k == "forwarded" or k.startswith("429 tether.budget_exhausted") for k in caller.outcomes), \
            caller.outcomes


def test_three_level_tree_and_the_budgets_command(world: World) -> None:
    """A budget narrowing down three levels; ``tether budgets`` shows the whole tree's counts (README)."""
    import subprocess
    import sys

    root = world.cp.issue("planner", budgeted(calls=20))
    mid = world.cp.delegate(root, "researcher", budgeted(calls=10))
    leaf = world.cp.delegate(mid, "fetcher", budgeted(calls=4))
    car = world.sidecar(leaf)
    session = requests.Session()
    session.trust_env = False
    statuses = [session.get(f"{world.tools.base}{ISSUES}", proxies=car.proxies(), timeout=10).status_code
                for _ in range(6)]
    assert statuses == [200] * 4 + [429] * 2  # the leaf's own budget is the tightest
    car.stop()
    out = subprocess.run([sys.executable, "-m", "tether", "budgets", "--agent", "planner"],
                         env=world.cp.env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("planner") and "calls 4/20 used, 0 leased, 16 left" in lines[1]
    assert "researcher" in lines[2] and "calls 4/10 used, 0 leased, 6 left" in lines[3]
    assert "fetcher" in lines[4] and "calls 4/4 used, 0 leased, 0 left" in lines[5]


def test_approval_tier_calls_count_when_forwarded_not_when_held(world: World) -> None:
    """``calls=2`` on an approval-tier capability: a denied call and a held one cost nothing; two approved
    calls spend the budget; a third, approved too, is refused ``budget_exhausted`` and never reaches the
    tool."""
    from concurrent.futures import ThreadPoolExecutor

    ident = world.cp.issue("approver", {"issues.write": {"tier": "approval", "calls": 2}})
    car = world.sidecar(ident)
    admin = world.cp.client()

    def post(n: int) -> requests.Response:
        return requests.post(f"{world.tools.base}{ISSUES}", json={"n": n}, proxies=car.proxies(), timeout=30)

    def decide(n: int, action: str) -> None:
        pending = wait_until(lambda: [a for a in admin.request("GET", "/v1/approvals?status=pending")
                                      if f'"n": {n}' in ((a.get("request") or {}).get("body") or "")], 10,
                             what=f"call {n} held")
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/{action}", {})

    with ThreadPoolExecutor(1) as pool:
        for n, action, expected in ((0, "deny", (403, "tether.approval_denied")), (1, "approve", (200, None)),
                                    (2, "approve", (200, None)), (3, "approve", (429, "tether.budget_exhausted"))):
            held = pool.submit(post, n)
            decide(n, action)
            resp = held.result(timeout=30)
            assert (resp.status_code, resp.headers.get("Tether-Error")) == expected, n
            if n == 0:  # denied, and while it was held: nothing counted
                assert budget_view(world.cp, ident.jti)["budgets"]["issues.write"]["used"] == 0
    assert world.tools.hits_for(ISSUES) == 2
    view = budget_view(world.cp, ident.jti)["budgets"]["issues.write"]
    assert view["used"] + view["leased"] >= 2 and view["left"] == 0
