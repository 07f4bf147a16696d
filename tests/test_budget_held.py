"""Budget slices a heartbeat holds (docs/architecture.md, "Budget slices a heartbeat holds").

A replica that crashes after taking a slice but before answering leaves it open and leased to a live run that
never received it. The run's heartbeat names what it holds (``Heartbeat.budget_slices``: the number of its last
slice request, and the tags of every slice it holds, is still asking for, or is settling) and the sweep returns
whole an open slice asked for at or before that number and not held (``services/budgets.given_up``).

The safety property: a slice the sweep returns is never one the sidecar spends or settles, whatever the order
in which requests, answers, settlements and heartbeats arrive, however late or stale a heartbeat is read.
First the rule by table, then by a hypothesis state machine of the protocol (every interleaving of the
sidecar's obligations with the control plane's take, settle and sweep), then with real parts: the sidecar's
``Budgets`` over its real channel to a real control plane, and the control plane's sweep by what a run's
heartbeat says.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tether.capability import keys, protocol
from tether.capability.chain import Verifier, parse_chain_unverified
from tether.capability.errors import ApiError
from tether.capability.protocol import HeldSlices
from tether.controlplane.services.budgets import given_up, held_by
from tether.proxy.budget import Budgets
from tether.proxy.channel import ControlChannel

from .harness import ControlPlaneProcess, Identity, prepare_controlplane, wait_until

RUN = "run-1"


def slice_doc(tag: str, seq: int | None, run: str = RUN) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": f"{run}/{tag}", "run": run, "n": 4, "state": "open"}
    if seq is not None:
        doc["seq"] = seq
    return doc


# -- the rule, by table -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("doc", "held", "returned"), [
    (slice_doc("a", 3), HeldSlices(3, frozenset()), True),  # asked at the beat, not held: the answer was lost
    (slice_doc("a", 1), HeldSlices(3, frozenset({"b"})), True),
    (slice_doc("a", 3), HeldSlices(3, frozenset({"a"})), False),  # held (or still asked for, or settling)
    (slice_doc("a", 4), HeldSlices(3, frozenset()), False),  # asked after the beat: its answer may be on its way
    (slice_doc("a", None), HeldSlices(3, frozenset()), False),  # a sidecar that numbers no request: kept
    (slice_doc("a", 3), None, False),  # a heartbeat that names no slices: kept (fail closed)
    ({**slice_doc("a", 3), "seq": True}, HeldSlices(3, frozenset()), False),  # not a number: kept
    # The tag is what follows the run's own id: a tag another run's id ends with is not this slice's.
    (slice_doc("x/a", 2, run="r"), HeldSlices(2, frozenset({"a"})), True),
    ({**slice_doc("a", 2), "run": "other"}, HeldSlices(2, frozenset()), False),  # not named as take() names
    ({**slice_doc("a", 2), "run": None}, HeldSlices(2, frozenset()), False),
])
def test_given_up_by_table(doc: dict[str, Any], held: HeldSlices | None, returned: bool) -> None:
    assert given_up(doc, held) is returned


@pytest.mark.parametrize(("value", "fragment"), [
    ([], "'budget_slices' must be an object"),
    ({"held": []}, "'budget_slices.asked' must be a whole number"),
    ({"asked": -1, "held": []}, "'budget_slices.asked' must be a whole number"),
    ({"asked": True, "held": []}, "'budget_slices.asked' must be a whole number"),
    ({"asked": 1}, "'budget_slices.held' must be a list of slice tags"),
    ({"asked": 1, "held": [3]}, "'budget_slices.held' must be a list of slice tags"),
    ({"asked": 1, "held": [""]}, "'budget_slices.held' must be a list of slice tags"),
    ({"asked": 1, "held": ["t"] * (HeldSlices.MAX_HELD + 1)}, "holds more than"),
])
def test_a_heartbeat_naming_its_slices_wrongly_is_refused_naming_the_field(value: Any, fragment: str) -> None:
    with pytest.raises(ApiError) as err:
        protocol.Heartbeat.read({"budget_slices": value})
    assert err.value.http_status == 400 and err.value.code == "tether.bad_request"
    assert err.value.details.get("field") == "budget_slices" and fragment in err.value.message
    # What the control plane stored from a run is read the same way: unreadable means none (nothing returned).
    assert held_by({"budget_slices": value}) is None


def test_a_heartbeat_round_trips_its_slices() -> None:
    beat = protocol.Heartbeat(budget_slices={"asked": 7, "held": ["b", "a"]})
    again = protocol.Heartbeat.read(json.loads(json.dumps(beat.to_doc())))
    assert again.budget_slices == {"asked": 7, "held": ["b", "a"]}
    assert held_by({"budget_slices": again.budget_slices}) == HeldSlices(7, frozenset({"a", "b"}))
    assert protocol.Heartbeat.read({}).budget_slices is None and held_by({}) is None and held_by(None) is None


# -- the rule, by every interleaving ------------------------------------------------------------------------
class Protocol(RuleBasedStateMachine):
    """A sidecar keeping its side of the protocol (``tether/proxy/budget.py``), a control plane taking,
    settling and sweeping with :func:`given_up`, and a network that delays, reorders and loses every
    message. A slice the sweep returned must never be one the sidecar may still spend or settle."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.asking: dict[str, int] = {}  # tag -> seq: requests whose answer the sidecar still waits for
        self.holding: set[str] = set()  # answered: spent from, until sent for settlement
        self.settling: set[str] = set()  # settlement sent, not acknowledged
        self.takes: list[tuple[str, int]] = []  # in flight to the control plane
        self.answers: list[str] = []
        self.settles: list[str] = []
        self.acks: list[str] = []
        self.beats: list[HeldSlices] = []
        self.run_doc: HeldSlices | None = None  # the last heartbeat the control plane stored
        self.open: dict[str, dict[str, Any]] = {}  # tag -> slice doc
        self.closed: set[str] = set()
        self.returned: set[str] = set()

    def may_spend(self) -> set[str]:
        return set(self.asking) | self.holding | self.settling

    # the sidecar
    @rule()
    def ask(self) -> None:
        self.asked += 1
        tag = f"t{self.asked}"
        self.asking[tag] = self.asked  # numbered and named as asked in one step
        self.takes.append((tag, self.asked))

    @precondition(lambda self: self.asking)
    @rule(data=st.data())
    def give_up(self, data: st.DataObject) -> None:  # a timeout, a refused connection: never spent after this
        self.asking.pop(data.draw(st.sampled_from(sorted(self.asking))))

    @precondition(lambda self: self.holding)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        tag = data.draw(st.sampled_from(sorted(self.holding)))
        self.holding.discard(tag)
        self.settling.add(tag)
        self.settles.append(tag)

    @precondition(lambda self: self.settling)
    @rule(data=st.data())
    def settle_again(self, data: st.DataObject) -> None:  # no answer came: sent with the next request
        self.settles.append(data.draw(st.sampled_from(sorted(self.settling))))

    @rule()
    def beat(self) -> None:  # built in one step: a snapshot
        self.beats.append(HeldSlices(self.asked, frozenset(self.may_spend())))

    # the network: any message may arrive late, out of order, or never
    @staticmethod
    def _pop(queue: list[Any], data: st.DataObject) -> Any:
        return queue.pop(data.draw(st.integers(0, len(queue) - 1)))

    @precondition(lambda self: self.takes or self.answers or self.settles or self.acks or self.beats)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        queues = [q for q in (self.takes, self.answers, self.settles, self.acks, self.beats) if q]
        self._pop(data.draw(st.sampled_from(queues)), data)

    # the control plane
    @precondition(lambda self: self.takes)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        tag, seq = self._pop(self.takes, data)
        if tag not in self.open and tag not in self.closed:  # idempotent on the slice id
            self.open[tag] = slice_doc(tag, seq)
        self.answers.append(tag)

    @precondition(lambda self: self.answers)
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        tag = self._pop(self.answers, data)
        if tag in self.asking:  # an answer after the sidecar gave up is dropped
            del self.asking[tag]
            self.holding.add(tag)

    @precondition(lambda self: self.settles)
    @rule(data=st.data())
    def settle_arrives(self, data: st.DataObject) -> None:
        tag = self._pop(self.settles, data)
        assert tag not in self.returned, f"{tag} was returned whole, then settled: its used calls were lost"
        if tag in self.open:
            del self.open[tag]
            self.closed.add(tag)
        self.acks.append(tag)

    @precondition(lambda self: self.acks)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self.settling.discard(self._pop(self.acks, data))

    @precondition(lambda self: self.beats)
    @rule(data=st.data())
    def store_beat(self, data: st.DataObject) -> None:  # an older beat may land after a newer one
        self.run_doc = self._pop(self.beats, data)

    @rule()
    def sweep(self) -> None:
        for tag, doc in list(self.open.items()):
            if given_up(doc, self.run_doc):
                del self.open[tag]
                self.closed.add(tag)
                self.returned.add(tag)

    @invariant()
    def nothing_returned_is_spent(self) -> None:
        assert not self.returned & self.may_spend(), (self.returned, self.may_spend())

    def teardown(self) -> None:
        """Liveness: once nothing is in flight and the sidecar asks for nothing, one fresh beat and one sweep
        leave open only what the sidecar holds."""
        self.asking.clear()
        self.takes.clear()
        self.answers.clear()
        self.beat()
        self.store_beat_latest()
        self.sweep()
        self.nothing_returned_is_spent()
        assert set(self.open) <= self.holding | self.settling

    def store_beat_latest(self) -> None:
        self.run_doc = self.beats.pop()


TestProtocol = Protocol.TestCase
TestProtocol.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


# -- with real parts: the sidecar's Budgets and a control plane process -----------------------------------
@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("held"), 1, 2, 3, lease_ttl=30.0).start()
    try:
        yield proc
    finally:
        proc.stop()


def channel(cp: ControlPlaneProcess, ident: Identity, run: str) -> ControlChannel:
    leaf = parse_chain_unverified(ident.wire)[-1].hash
    return ControlChannel(cp.url, ident.agent, leaf, keys.load_private(ident.key_path.read_bytes()), run=run)


def budget_of(cp: ControlPlaneProcess, ident: Identity) -> dict[str, Any]:
    return cp.client().request("GET", f"/v1/budgets/{ident.jti}")["links"][0]["budgets"]["issues.read"]


def take(ch: ControlChannel, tag: str, seq: int | None, want: int = 3) -> Any:
    body: dict[str, Any] = {"capability": "issues.read", "want": want, "slice": tag}
    if seq is not None:
        body["seq"] = seq
    return ch.call("POST", "/v1/budgets/slices", body)


async def beat(ch: ControlChannel, asked: int, held: list[str]) -> None:
    await ch.heartbeat(protocol.Heartbeat(budget_slices={"asked": asked, "held": held}))


def test_the_sweep_returns_a_slice_the_run_gave_up_on_and_keeps_one_asked_after_the_beat(
        cp: ControlPlaneProcess, tmp_path: Path) -> None:
    """As a sidecar run, over the real API: a slice whose answer the run "lost" comes back to the budget once
    a heartbeat does not hold it; a slice asked for after that heartbeat was built (its answer still on the
    way) and one the heartbeat holds stay leased."""
    ident = cp.issue("held-run", {"issues.read": {"tier": "direct", "calls": 40}})

    async def go() -> None:
        ch = channel(cp, ident, "run-held")
        try:
            await ch.register(ident.wire)
            # Asked after the beat below was built (its seq is past the beat's), taken first: any sweep that sees
            # the lost slice sees this one too, and reads the same beat for both.
            later = await take(ch, "later", 2)
            lost = await take(ch, "lost", 1)
            assert later["calls"] == lost["calls"] == 3
            assert budget_of(cp, ident)["leased"] == 6
            await beat(ch, asked=1, held=[])
            after = wait_until(lambda: (b := budget_of(cp, ident))["leased"] == 3 and b, 20,
                               what="the lost slice returned")
            assert after["used"] == 0 and after["left"] == 37  # returned whole: none of it counted as spent
            # A slice the beat holds stays, though asked before it; a lost one beside it goes back.
            assert (await take(ch, "lost2", 3))["calls"] == 3
            await beat(ch, asked=3, held=["later"])
            wait_until(lambda: budget_of(cp, ident)["leased"] == 3, 20, what="the second lost slice returned")
            # The run settles what it holds: used moves, the rest returns; the sweep never touched it.
            answer = await ch.call("POST", "/v1/budgets/slices/return",
                                   {"slices": [{"slice": later["slice"], "used": 2}]})
            assert answer["settled"] == [{"slice": later["slice"], "used": 2, "returned": 1}]
            final = budget_of(cp, ident)
            assert (final["used"], final["leased"], final["left"]) == (2, 0, 38)
            # A slice taken without a number (a sidecar before this rule) is never returned by a beat.
            assert (await take(ch, "unnumbered", None))["calls"] == 3
            assert (await take(ch, "witness", 4))["calls"] == 3
            await beat(ch, asked=4, held=[])
            wait_until(lambda: budget_of(cp, ident)["leased"] == 3, 20, what="the witness slice returned")
        finally:
            await ch.close()

    asyncio.run(go())


def test_a_heartbeat_with_unreadable_slices_is_a_400_naming_the_field(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("held-bad", {"issues.read": {"tier": "direct", "calls": 5}})

    async def go() -> None:
        ch = channel(cp, ident, "run-bad")
        try:
            await ch.register(ident.wire)
            with pytest.raises(ApiError) as err:
                await ch.call("POST", protocol.HEARTBEAT, {"budget_slices": {"asked": "1", "held": []}})
            assert err.value.http_status == 400 and err.value.code == "tether.bad_request"
            assert "budget_slices.asked" in err.value.message
            with pytest.raises(ApiError) as err:
                await take(ch, "a/b", 1)
            assert err.value.http_status == 400 and "no '/'" in err.value.message
        finally:
            await ch.close()

    asyncio.run(go())


def test_the_sidecars_budgets_hold_what_they_ask_for_spend_and_settle(cp: ControlPlaneProcess) -> None:
    """``Budgets.held()`` as the sidecar builds its heartbeat: a request in flight is held under its tag and
    number from the moment it is asked; an answered slice is held while it is spent; a used-up slice is held
    until the control plane acknowledges its settlement, and a settlement that got no answer is sent again."""
    ident = cp.issue("held-budgets", {"issues.read": {"tier": "direct", "calls": 40}})
    trust = keys.load_private(cp.signing_key_path.read_bytes()).public_key()
    verified = Verifier(trust).verify(ident.wire, now=time.time())

    async def go() -> None:
        ch = channel(cp, ident, "run-budgets")
        budgets = Budgets(verified, ch)
        try:
            await ch.register(ident.wire)
            assert budgets.held() == {"asked": 0, "held": []}
            waiting = budgets.spend(["issues.read"], "call-1")
            assert waiting is not None  # no slice yet: the call waits for one
            task = asyncio.ensure_future(waiting)
            for _ in range(100):  # a few turns of the loop: the call's wait starts the request
                if budgets.asked:
                    break
                await asyncio.sleep(0)
            first = budgets.held()
            assert first is not None and first["asked"] == 1 and len(first["held"]) == 1
            await task
            (tag,) = first["held"]
            pool = budgets.pools["issues.read"]
            (held_slice,) = pool.slices
            # The first slice is one call (a sidecar starts small): spending it asked for the next at once.
            assert held_slice.tag == tag and held_slice.n == held_slice.spent == 1
            (asking,) = budgets.asking
            assert pool.fetching is not None and budgets.held() == {"asked": 2, "held": sorted([tag, asking])}
            await pool.fetching
            (_, next_slice) = pool.slices
            assert next_slice.tag == asking and budgets.held() == {"asked": 2, "held": sorted([tag, asking])}
            await budgets.flush()  # the used-up slice is settled and acknowledged: no longer held
            assert budget_of(cp, ident)["used"] == 1
            assert budgets.held() == {"asked": 2, "held": [next_slice.tag]}
            # A settlement that gets no answer stays held, and is sent again.
            next_slice.spent = next_slice.n
            reachable = ch.url
            ch.url = "http://127.0.0.1:9"  # nothing listens there: the settlement is not answered
            with pytest.raises(ApiError):
                await budgets.flush()
            assert budgets.held() == {"asked": 2, "held": [next_slice.tag]} and budgets.to_settle == [next_slice]
            assert budget_of(cp, ident)["leased"] == next_slice.n  # the control plane never heard of it
            ch.url = reachable
            await budgets.flush()
            assert budgets.held() == {"asked": 2, "held": []}
            final = budget_of(cp, ident)
            assert (final["used"], final["leased"]) == (held_slice.n + next_slice.n, 0)
        finally:
            await ch.close()

    asyncio.run(go())
