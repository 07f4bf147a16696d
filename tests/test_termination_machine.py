"""The termination protocol and its record, pure: no sockets, no clock, milliseconds per test.

Covers ``tether/controlplane/termination.py``: the transition table (every legal path, every illegal edge), a
property over arbitrary acknowledgement / time / lost-write sequences (one ordered walk to exactly one
``terminated``, never skipping ``reconciling``), what ``build_record`` says about every call, agent and
lease, and how ``seal`` / ``verify_records`` catch an edited, removed, reordered or duplicated record and a
wrong key.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import keys
from tether.capability.jsonpieces import canonical_json
from tether.controlplane import termination as proto

T0 = 1_750_000_000.0
STATES = (proto.REQUESTED, proto.DRAINING, proto.ABORTING, proto.RECONCILING, proto.TERMINATED)
LEGAL = {
    (proto.REQUESTED, proto.DRAINING),
    (proto.REQUESTED, proto.ABORTING),
    (proto.DRAINING, proto.RECONCILING),
    (proto.ABORTING, proto.RECONCILING),
    (proto.RECONCILING, proto.TERMINATED),
}
FIRST_ACTIONS = (proto.REVOKE_SUBTREE, proto.DENY_APPROVALS, proto.SEND_COMMANDS)
KEY = keys.generate()
OTHER_KEY = keys.generate()


def term(
    mode: str = "drain",
    agents: tuple[str, ...] = ("root", "a", "b"),
    window: float = 10.0,
    grace: float = 2.0,
    now: float = T0,
) -> dict[str, Any]:
    return proto.new_termination("term-1", "root", mode, window, "test", "admin", now, agents, grace)


def at_state(state: str, mode: str = "drain") -> dict[str, Any]:
    """A document in ``state``, reached through the protocol itself."""
    doc = term(mode)
    if state == proto.REQUESTED:
        return doc
    doc = proto.advance(doc, (), T0).doc
    if state in (proto.DRAINING, proto.ABORTING):
        return doc
    doc = proto.advance(doc, doc["agents"], T0 + 1).doc
    if state == proto.RECONCILING:
        return doc
    return proto.finish(doc, "rec-1", T0 + 2)


# -- the transition table --------------------------------------------------------------------------------
def test_table_is_exactly_the_design_paths() -> None:
    edges = {(src, dst) for src, dsts in proto.TRANSITIONS.items() for dst in dsts}
    assert edges == LEGAL
    assert set(proto.TRANSITIONS) == set(STATES)
    assert proto.TRANSITIONS[proto.TERMINATED] == ()


@pytest.mark.parametrize("mode", proto.MODES)
def test_every_action_the_machine_answers_is_in_its_action_list(mode: str) -> None:
    """``proto.ACTIONS`` is every action ``advance`` answers, in any state, acknowledged or not, early or late:
    the list the driver's table is checked against below."""
    answered: set[str] = set()
    for state in STATES:
        doc = at_state(state, mode)
        for acked, now in itertools.product(((), doc["agents"]), (T0, T0 + 1000)):
            answered.update(proto.advance(doc, acked, now).actions)
    assert answered == set(proto.ACTIONS)


def test_the_driver_dispatches_every_action_from_one_table() -> None:
    """The termination service carries out each action through ``TerminationService.ACTIONS``, which has one
    coroutine per action of the machine and nothing else (no branch elsewhere decides what an action does)."""
    import inspect

    from tether.controlplane.services.terminations import TerminationService

    assert set(TerminationService.ACTIONS) == set(proto.ACTIONS)
    assert all(inspect.iscoroutinefunction(handler) for handler in TerminationService.ACTIONS.values())


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(STATES, STATES)))
def test_every_edge_is_legal_or_raises(src: str, dst: str) -> None:
    mode = "abort" if src == proto.ABORTING else "drain"
    doc = at_state(src, mode)
    before = copy.deepcopy(doc)
    if (src, dst) in LEGAL:
        moved = proto._moved(doc, dst, T0 + 5)
        assert moved["state"] == dst
        assert moved["version"] == doc["version"] + 1
        assert moved["history"][-1] == {"state": dst, "at": T0 + 5}
    else:
        with pytest.raises(proto.IllegalTransition, match=f"{src} -> {dst}"):
            proto._moved(doc, dst, T0 + 5)
    assert doc == before  # the input document is never mutated


@pytest.mark.parametrize("state", [s for s in STATES if s != proto.RECONCILING])
def test_finish_outside_reconciling_is_illegal(state: str) -> None:
    with pytest.raises(proto.IllegalTransition):
        proto.finish(at_state(state, "abort" if state == proto.ABORTING else "drain"), "rec-x", T0 + 9)


def test_new_termination_document() -> None:
    doc = term("abort", agents=("b", "root", "a", "b"), window=7, grace=3, now=T0)
    assert doc["state"] == proto.REQUESTED
    assert doc["agents"] == ["a", "b", "root"]
    assert doc["deadline"] == T0 + 7
    assert doc["window_s"] == 7.0 and doc["grace_s"] == 3.0
    assert doc["history"] == [{"state": proto.REQUESTED, "at": T0}]
    assert doc["version"] == 1 and doc["record_id"] is None and doc["completed_at"] is None
    json.dumps(doc)  # stored as JSON


@pytest.mark.parametrize(("mode", "window"), [("kill", 1), ("", 1), ("drain", -1), ("abort", 86400.5)])
def test_new_termination_refuses_bad_input(mode: str, window: float) -> None:
    with pytest.raises(ValueError):
        term(mode, window=window)


@pytest.mark.parametrize(("mode", "middle"), [("drain", proto.DRAINING), ("abort", proto.ABORTING)])
def test_legal_path_when_everyone_acknowledges(mode: str, middle: str) -> None:
    doc = term(mode)
    step = proto.advance(doc, (), T0 + 0.1)
    assert step.doc["state"] == middle
    assert step.actions == FIRST_ACTIONS
    doc = step.doc
    for acked in ((), ("root",), ("root", "a")):  # somebody is still missing, window not over
        step = proto.advance(doc, acked, T0 + 1)
        assert step.doc is doc and step.actions == ()
    step = proto.advance(doc, ("a", "b", "root", "stranger"), T0 + 2)
    assert step.doc["state"] == proto.RECONCILING
    assert step.actions == (proto.WRITE_RECORD,)
    doc = step.doc
    again = proto.advance(doc, (), T0 + 3)  # the record write failed or the CP restarted: write again
    assert again.doc is doc and again.actions == (proto.WRITE_RECORD,)
    done = proto.finish(doc, "rec-9", T0 + 4)
    assert done["state"] == proto.TERMINATED
    assert done["record_id"] == "rec-9" and done["completed_at"] == T0 + 4
    assert [h["state"] for h in done["history"]] == [proto.REQUESTED, middle, proto.RECONCILING, proto.TERMINATED]
    assert done["version"] == 4
    final = proto.advance(done, ("a", "b", "root"), T0 + 100)
    assert final.doc is done and final.actions == ()


@pytest.mark.parametrize("mode", proto.MODES)
def test_missing_acknowledgements_wait_for_window_plus_grace(mode: str) -> None:
    doc = proto.advance(term(mode, window=10, grace=2), (), T0).doc
    for now in (T0 + 5, T0 + 10, T0 + 11.999):
        assert proto.advance(doc, ("root", "a"), now).doc["state"] == doc["state"]
    step = proto.advance(doc, ("root", "a"), T0 + 12)
    assert step.doc["state"] == proto.RECONCILING and step.actions == (proto.WRITE_RECORD,)


@pytest.mark.parametrize("mode", proto.MODES)
def test_an_agent_that_never_ran_a_sidecar_is_not_waited_for(mode: str) -> None:
    """No run, nothing in flight and its link revoked in the first step: its acknowledgement cannot come, so
    the termination reconciles as soon as the agents that did run have acknowledged (not at window + grace);
    one that ran and is silent is still waited for."""
    doc = proto.advance(term(mode, window=30, grace=5), (), T0).doc
    step = proto.advance(doc, ("root", "a"), T0 + 0.5, never_ran=("b",))
    assert step.doc["state"] == proto.RECONCILING and step.actions == (proto.WRITE_RECORD,)
    assert proto.advance(doc, ("root",), T0 + 0.5, never_ran=("b",)).doc["state"] == doc["state"]  # "a" ran
    alone = proto.advance(term(mode, agents=("ghost",), window=30, grace=5), (), T0).doc
    assert proto.advance(alone, (), T0, never_ran=("ghost",)).doc["state"] == proto.RECONCILING


def test_empty_subtree_reconciles_at_once() -> None:
    doc = proto.advance(term(agents=()), (), T0).doc
    assert proto.advance(doc, (), T0).doc["state"] == proto.RECONCILING


# -- the protocol as a property --------------------------------------------------------------------------
AGENTS = ("root", "a", "b", "c")
events = st.lists(
    st.one_of(
        st.tuples(st.just("ack"), st.sampled_from(AGENTS)),
        st.tuples(st.just("tick"), st.floats(0, 5, allow_nan=False)),
        st.tuples(st.just("lost"), st.none()),  # the driver computed a step but died before saving it
        st.tuples(st.just("write_fails"), st.none()),  # the record write failed this round
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    mode=st.sampled_from(proto.MODES),
    agents=st.sets(st.sampled_from(AGENTS), max_size=len(AGENTS)),
    window=st.floats(0, 20, allow_nan=False),
    grace=st.floats(0, 5, allow_nan=False),
    script=events,
)
def test_any_sequence_ends_terminated_once_in_order(
    mode: str, agents: set[str], window: float, grace: float, script: list[tuple[str, Any]]
) -> None:
    middle = proto.DRAINING if mode == "drain" else proto.ABORTING
    saved = proto.new_termination("term-p", "root", mode, window, "", "admin", T0, agents, grace)
    now, acked, lose_next, fail_next = T0, set(), False, False
    finishes = 0
    first_actions = 0

    def drive() -> None:
        nonlocal saved, lose_next, fail_next, finishes, first_actions
        step = proto.advance(saved, acked, now)
        if FIRST_ACTIONS[0] in step.actions:
            assert step.actions == FIRST_ACTIONS
            first_actions += 1
        if step.doc["state"] == proto.RECONCILING and saved["state"] == middle:
            # leaving draining/aborting only when everyone answered or the window plus grace is over
            assert set(saved["agents"]) <= acked or now >= saved["deadline"] + saved["grace_s"]
        new = step.doc
        if proto.WRITE_RECORD in step.actions:
            assert new["state"] == proto.RECONCILING
            if not fail_next:
                new = proto.finish(new, "rec-p", now)
                finishes += 1
            fail_next = False
        else:
            assert new["state"] != proto.TERMINATED
        if lose_next:
            lose_next = False
            if new["state"] == proto.TERMINATED:
                finishes -= 1  # nothing was saved: the record write is repeated, never duplicated
            return
        saved = new

    for kind, value in script:
        if saved["state"] == proto.TERMINATED:
            break
        if kind == "ack":
            acked.add(value)
        elif kind == "tick":
            now += value
        elif kind == "lost":
            lose_next = True
        else:
            fail_next = True
        drive()
    for _ in range(10):  # time alone must finish it: window plus grace, then write the record
        if saved["state"] == proto.TERMINATED:
            break
        now = max(now, saved["deadline"] + saved["grace_s"])
        drive()

    states = [h["state"] for h in saved["history"]]
    assert states == [proto.REQUESTED, middle, proto.RECONCILING, proto.TERMINATED]
    assert states.count(proto.TERMINATED) == 1
    assert finishes == 1
    assert first_actions >= 1  # repeated only when a step was lost before it was saved
    times = [h["at"] for h in saved["history"]]
    assert times == sorted(times)
    assert saved["version"] == 4
    assert proto.advance(saved, acked, now + 1000).actions == ()
    with pytest.raises(proto.IllegalTransition):
        proto.finish(saved, "rec-again", now)


# -- the record --------------------------------------------------------------------------------------------
def report(
    call_id: str, agent: str, started: float, resolution: str, status: int | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "call_id": call_id,
        "agent": agent,
        "capability": "slow.read",
        "method": "GET",
        "url": "http://127.0.0.1:1/slow",
        "started_at": started,
        "resolution": resolution,
        "status": status,
        "capture_ref": f"cap:{call_id}",
        "ended_at": started + 1,
        "received_at": started + 2,
        **extra,
    }


def inflight(call_id: str, started: float) -> dict[str, Any]:
    return {
        "call_id": call_id,
        "capability": "slow.read",
        "method": "GET",
        "url": "http://127.0.0.1:1/slow",
        "started_at": started,
        "phase": "forwarded",
    }


def link(jti: str, sub: str, exp: float, registered: float) -> dict[str, Any]:
    return {"jti": jti, "sub": sub, "hash": f"h-{jti}", "claims": {"exp": exp}, "registered_at": registered}


def as_runs(sidecars: dict[str, dict[str, Any]], acked: Any = ()) -> dict[str, Any]:
    """One run per agent (its id ``run-AGENT``, on link ``h-j-AGENT``) and an acknowledgement from each of
    the ``acked`` agents' runs: the shape build_record takes since commands and acks belong to runs."""
    runs = [{"run_id": f"run-{a}", "agent": a, "link": f"h-j-{a}", **doc} for a, doc in sidecars.items()]
    acks = {f"run-{a}": {"at": (acked[a] or {}).get("at", T0) if isinstance(acked, dict) else T0} for a in acked}
    return {"runs": runs, "acks": acks}


def sample_record(prev_hash: str = "", record_id: str = "rec-1", termination_id: str = "term-1") -> dict[str, Any]:
    doc = {**term(agents=("root", "a", "b", "ghost")), "id": termination_id}
    return proto.build_record(
        doc,
        record_id=record_id,
        reports=[
            report("c3", "a", T0 + 3, "unknown", code="tether.aborted"),
            report("c1", "root", T0 + 1, "completed", 200),
            report("c2", "a", T0 + 2, "refused", code="tether.draining"),
            report("c5", "b", T0 + 0.5, "completed", 201),  # b reported this one before it went silent
        ],
        links=[
            link("j-root", "root", T0 + 3600, T0),
            link("j-a", "a", T0 + 3600, T0 + 1),
            link("j-b", "b", T0 + 5, T0 + 2),
        ],
        revocations={"j-root": {"at": T0 + 10}, "j-a": {"at": T0 + 10}, "j-b": {"at": T0 + 10}},
        **as_runs(
            {
                "root": {"last_seen": T0 + 9, "lease_expires": T0 + 12, "inflight": []},
                "a": {"last_seen": T0 + 9, "lease_expires": T0 + 12, "inflight": [inflight("c3", T0 + 3)]},
                "b": {
                    "last_seen": T0 + 4,
                    "lease_expires": T0 + 7,
                    "inflight": [inflight("c5", T0 + 0.5), inflight("c4", T0 + 3.5), inflight("c6", T0 + 3.7)],
                },
            },
            {"root": {"at": T0 + 11}, "a": {"at": T0 + 11}},
        ),
        prev_hash=prev_hash,
        now=T0 + 20,
    )


RECORD_FIELDS = {
    "record_id",
    "termination_id",
    "subject",
    "mode",
    "requested_by",
    "requested_at",
    "completed_at",
    "window_s",
    "calls",
    "leases",
    "agents_terminated",
    "agents_unaccounted",
    "prev_hash",
}
CALL_FIELDS = {"call_id", "agent", "capability", "method", "url", "started_at", "resolution", "status", "capture_ref"}


def test_record_has_the_design_fields() -> None:
    record = sample_record()
    assert RECORD_FIELDS <= set(record)
    assert record["subject"] == "root" and record["mode"] == "drain" and record["requested_by"] == "admin"
    assert record["requested_at"] == T0 and record["completed_at"] == T0 + 20 and record["window_s"] == 10.0
    for call in record["calls"]:
        assert CALL_FIELDS <= set(call)
        assert call["resolution"] in proto.RESOLUTIONS
    assert canonical_json(record) == canonical_json(json.loads(json.dumps(record)))


def test_record_accounts_for_every_call_once() -> None:
    calls = {c["call_id"]: c for c in sample_record()["calls"]}
    assert len(calls) == len(sample_record()["calls"]) == 6
    # reported calls keep what the sidecar said, in start order, unreported ones follow
    assert [c["call_id"] for c in sample_record()["calls"]] == ["c5", "c1", "c2", "c3", "c4", "c6"]
    assert calls["c1"]["resolution"] == "completed" and calls["c1"]["status"] == 200
    assert calls["c2"]["resolution"] == "refused" and calls["c2"]["code"] == "tether.draining"
    assert calls["c3"]["resolution"] == "unknown" and calls["c3"]["capture_ref"] == "cap:c3"
    assert calls["c5"]["resolution"] == "completed" and calls["c5"].get("reported", True) is True
    for cid in ("c4", "c6"):  # last seen in flight at the silent sidecar b, never heard of again
        assert calls[cid]["agent"] == "b"
        assert calls[cid]["resolution"] == "unknown"
        assert calls[cid]["status"] is None
        assert calls[cid]["reported"] is False
    assert all("reported" not in calls[c] for c in ("c1", "c2", "c3", "c5"))


def test_record_names_terminated_and_unaccounted_agents() -> None:
    record = sample_record()
    assert proto.terminated_agents(record) == ["a", "root"]
    assert [(e["agent"], e["run_id"]) for e in record["agents_terminated"]] == [("a", "run-a"), ("root", "run-root")]
    unaccounted = {u["agent"]: u for u in record["agents_unaccounted"]}
    assert set(unaccounted) == {"b", "ghost"}
    b = unaccounted["b"]
    assert b["last_seen"] == T0 + 4
    assert [c["call_id"] for c in b["calls_in_flight_last_known"]] == ["c4", "c6"]  # c5 was reported
    ghost = unaccounted["ghost"]  # registered but never heartbeated
    assert ghost["last_seen"] is None and ghost["calls_in_flight_last_known"] == []


def test_record_leases_revoked_or_expired() -> None:
    leases = {lease["jti"]: lease for lease in sample_record()["leases"]}
    assert [lease["jti"] for lease in sample_record()["leases"]] == ["j-root", "j-a", "j-b"]
    assert leases["j-root"] == {"jti": "j-root", "agent": "root", "revoked_at": T0 + 10}
    assert leases["j-a"]["revoked_at"] == T0 + 10 and "expired_at" not in leases["j-a"]
    # j-b's link had expired (T0 + 5) before the revocation (T0 + 10): it is listed as expired, not revoked
    assert leases["j-b"]["expired_at"] == T0 + 5 and "revoked_at" not in leases["j-b"]
    assert leases["j-b"]["agent"] == "b"


def test_record_lease_never_revoked_is_expired() -> None:
    record = proto.build_record(
        term(agents=("root",)),
        record_id="r",
        reports=[],
        links=[link("j", "root", T0 + 60, T0)],
        revocations={},
        runs=[],
        acks={},
        prev_hash="",
        now=T0 + 70,
    )
    assert record["leases"] == [{"jti": "j", "agent": "root", "expired_at": T0 + 60}]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_record_lists_each_known_call_exactly_once(data: st.DataObject) -> None:
    agents = ["root", "a", "b"]
    ids = [f"c{i}" for i in range(data.draw(st.integers(0, 12)))]
    owner = {cid: data.draw(st.sampled_from(agents)) for cid in ids}
    reported = data.draw(st.sets(st.sampled_from(ids))) if ids else set()
    seen_inflight = data.draw(st.sets(st.sampled_from(ids))) if ids else set()
    acked = data.draw(st.sets(st.sampled_from(agents)))
    record = proto.build_record(
        term(agents=tuple(agents)),
        record_id="r",
        prev_hash="",
        now=T0 + 50,
        reports=[report(cid, owner[cid], T0 + i, "completed", 200) for i, cid in enumerate(ids) if cid in reported],
        links=[],
        revocations={},
        **as_runs(
            {
                a: {
                    "last_seen": T0,
                    "lease_expires": T0 + 3,
                    "inflight": [inflight(c, T0) for c in ids if c in seen_inflight and owner[c] == a],
                }
                for a in agents
            },
            {a: {} for a in acked},
        ),
    )
    listed = [c["call_id"] for c in record["calls"]]
    assert len(listed) == len(set(listed))
    lost = {c for c in seen_inflight - reported if owner[c] not in acked}
    assert set(listed) == reported | lost
    for call in record["calls"]:
        if call["call_id"] in lost:
            assert call["resolution"] == "unknown" and call["reported"] is False
        else:
            assert "reported" not in call
    assert sorted(proto.terminated_agents(record)) == sorted(acked)
    assert {u["agent"] for u in record["agents_unaccounted"]} == set(agents) - acked


# -- seal and verify -----------------------------------------------------------------------------------------
def log_of(n: int, key: Any = KEY) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for i in range(n):
        prev = records[-1]["hash"] if records else ""
        records.append(proto.seal(sample_record(prev, f"rec-{i}", f"term-{i}"), key))
    return records


def test_sealed_log_verifies() -> None:
    records = log_of(4)
    assert records[0]["prev_hash"] == ""
    for earlier, later in itertools.pairwise(records):
        assert later["prev_hash"] == earlier["hash"]
    for record in records:
        assert record["hash"] == proto.record_hash(record) and record["hash"].startswith("sha256:")
    result = proto.verify_records(records, KEY.public_key())
    assert result.ok and result.count == 4 and result.problems == ()
    assert proto.verify_records([], KEY.public_key()).ok
    # what the control plane serves is JSON: a round trip changes nothing
    assert proto.verify_records(json.loads(json.dumps(records)), KEY.public_key()).ok


def problems(records: list[dict[str, Any]], key: Any = KEY) -> tuple[str, ...]:
    result = proto.verify_records(records, key.public_key())
    assert not result.ok and result.problems
    return result.problems


@pytest.mark.parametrize("index", [0, 2, 3])
def test_edited_record_is_caught(index: int) -> None:
    records = log_of(4)
    records[index]["calls"][0]["resolution"] = (
        "completed" if records[index]["calls"][0]["resolution"] != "completed" else "unknown"
    )
    found = problems(records)
    assert any(p.startswith(f"record {index} ") and "edited" in p for p in found)


def test_edited_and_rehashed_record_fails_its_signature() -> None:
    records = log_of(3)
    records[1]["agents_unaccounted"] = []
    records[1]["hash"] = proto.record_hash(records[1])  # an attacker without the key recomputes the hash
    found = problems(records)
    assert any(p.startswith("record 1 ") and "signature" in p for p in found)
    assert any(p.startswith("record 2 ") and "prev_hash" in p for p in found)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_removed_record_is_caught(index: int) -> None:
    records = log_of(4)
    del records[index]
    found = problems(records)
    assert any(p.startswith(f"record {index} ") and "removed" in p for p in found)


def test_reordered_records_are_caught() -> None:
    records = log_of(4)
    records[1], records[2] = records[2], records[1]
    found = problems(records)
    assert any(p.startswith("record 1 ") and "reordered" in p for p in found)


@pytest.mark.parametrize("where", ["end", "adjacent"])
def test_duplicated_record_is_caught(where: str) -> None:
    records = log_of(3)
    if where == "end":
        records.append(copy.deepcopy(records[0]))
    else:
        records.insert(2, copy.deepcopy(records[1]))
    found = problems(records)
    assert any("appears twice" in p for p in found)


def test_wrong_key_fails_every_signature() -> None:
    records = log_of(3)
    found = problems(records, OTHER_KEY)
    assert len([p for p in found if "signature" in p]) == 3
    forged = log_of(3, OTHER_KEY)  # a whole log sealed by another key
    assert len([p for p in problems(forged) if "signature" in p]) == 3


def test_garbage_signature_is_a_problem_not_a_crash() -> None:
    records = log_of(2)
    records[1]["signature"] = "!!not base64!!"
    assert any(p.startswith("record 1 ") and "signature" in p for p in problems(records))
    records = log_of(2)
    del records[0]["signature"]
    assert any(p.startswith("record 0 ") and "signature" in p for p in problems(records))


# -- addenda: agents that acknowledge after the record ----------------------------------------------------
def test_a_late_acknowledgement_becomes_an_addendum_with_the_calls_not_yet_reported() -> None:
    doc = {**term(agents=("root", "a", "b", "ghost")), "id": "term-1"}
    original = proto.seal(sample_record("", "rec-1"), KEY)
    assert [u["agent"] for u in original["agents_unaccounted"]] == ["b", "ghost"]
    runs = as_runs({a: {"last_seen": T0} for a in ("root", "a", "b")})["runs"]
    assert proto.build_addendum(doc, [original], record_id="rec-2", reports=[], runs=runs,
                                acks=as_runs({}, ("root", "a"))["acks"],
                                prev_hash=original["hash"], now=T0 + 30) is None  # nobody new: nothing to add
    late_reports = [
        report("c5", "b", T0 + 0.5, "completed", 201),  # already in the record as reported: not repeated
        report("c4", "b", T0 + 3.5, "completed", 200),  # listed as unknown/unreported before: now known
        report("c7", "b", T0 + 6, "refused", code="tether.draining"),  # never seen before
        report("c3", "a", T0 + 3, "unknown", code="tether.aborted"),  # another agent's: not this addendum's
    ]
    addendum = proto.build_addendum(doc, [original], record_id="rec-2", reports=late_reports, runs=runs,
                                    acks=as_runs({}, {"b": {"at": T0 + 40}})["acks"],
                                    prev_hash=original["hash"], now=T0 + 41)
    assert addendum is not None
    assert addendum["amends"] == "rec-1" and addendum["termination_id"] == doc["id"]
    assert [c["call_id"] for c in addendum["calls"]] == ["c4", "c7"]
    assert proto.terminated_agents(addendum) == ["b"] and addendum["agents_terminated"][0]["run_id"] == "run-b"
    assert [u["agent"] for u in addendum["agents_unaccounted"]] == ["ghost"]
    assert addendum["acknowledgements"]["b"]["state"] == "acknowledged_late"
    sealed = proto.seal(addendum, KEY)
    assert proto.verify_records([original, sealed], KEY.public_key()).ok
    assert proto.build_addendum(doc, [original, sealed], record_id="rec-3", reports=late_reports, runs=runs,
                                acks=as_runs({}, ("b",))["acks"], prev_hash=sealed["hash"], now=T0 + 50) is None


def test_finish_remembers_who_is_still_unaccounted() -> None:
    doc = proto.advance(proto.advance(term(), (), T0).doc, ("root",), T0 + 100).doc
    assert proto.finish(doc, "rec-1", T0 + 101, ["b", "a"])["open_agents"] == ["a", "b"]
