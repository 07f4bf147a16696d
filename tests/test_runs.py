"""Sidecar runs (tether/controlplane/runs.py): which runs vouch for an agent, by table and by property."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.controlplane import runs

T0 = 1_700_000_000.0


def run(run_id: str, agent: str = "a", **extra: Any) -> dict[str, Any]:
    return {"run_id": run_id, "agent": agent, "link": f"L-{agent}", "last_seen": T0, "lease_expires": T0 + 15,
            **extra}


def test_an_acknowledging_run_accounts_for_its_agent() -> None:
    out = runs.accounted(["a"], [run("r1")], {"r1": {"at": T0 + 1}})
    assert out == {"a": {"agent": "a", "run_id": "r1", "at": T0 + 1, "state": "terminated", "runs": ["r1"]}}


def test_one_silent_run_leaves_the_agent_unaccounted() -> None:
    """Two sidecars of one link (or the old run of a partitioned agent): one answering is not enough."""
    both = [run("r1"), run("r2")]
    assert runs.accounted(["a"], both, {"r2": {"at": T0}}) == {}
    assert [r["run_id"] for r in runs.unaccounted_runs("a", both, {"r2": {"at": T0}})] == ["r1"]


def test_an_agent_without_any_run_is_not_accounted() -> None:
    assert runs.accounted(["ghost"], [run("r1")], {"r1": {"at": T0}}) == {}


def test_another_agents_acknowledgement_never_counts() -> None:
    assert runs.accounted(["a"], [run("r1", "a"), run("r2", "b")], {"r2": {"at": T0}}) == {}


def test_final_states_said_by_the_run_account_for_it() -> None:
    stopped = run("r1", final="stopped", final_at=T0 + 2)
    earlier = run("r2", final="terminated", final_at=T0 + 3)  # quiesced for an earlier termination
    out = runs.accounted(["a"], [stopped, earlier], {})
    assert out["a"]["run_id"] == "r2" and out["a"]["state"] == "terminated" and out["a"]["runs"] == ["r1", "r2"]


def test_a_superseded_run_answers_through_its_successor() -> None:
    old = run("r1", final="superseded", superseded_by="r2")
    new = run("r2")
    assert runs.accounted(["a"], [old, new], {}) == {}
    out = runs.accounted(["a"], [old, new], {"r2": {"at": T0 + 5}})
    assert out["a"]["run_id"] == "r2"


def test_supersession_cycles_and_missing_successors_do_not_account() -> None:
    loop = [run("r1", final="superseded", superseded_by="r2"), run("r2", final="superseded", superseded_by="r1")]
    assert runs.accounted(["a"], loop, {}) == {}
    assert runs.accounted(["a"], [run("r1", final="superseded", superseded_by="gone")], {}) == {}


def test_run_states() -> None:
    assert runs.run_state(run("r", state="draining"), T0) == "draining"
    assert runs.run_state(run("r", state="serving"), T0 + 20) == runs.LAPSED
    assert runs.run_state(run("r", final="stopped"), T0 + 20) == "stopped"
    view = runs.run_view(run("r", final="terminated", inflight=[{}, {}]), T0)
    assert view["state"] == "terminated" and view["lease"] == "expired" and view["inflight"] == 2


def test_owner_keys() -> None:
    assert runs.owner_key(None) == runs.CONTROL_PLANE_OWNER
    assert runs.owner_key("planner") == "agent:planner"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_accounted_iff_every_run_has_its_own_or_a_successors_word(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 5))
    ids = [f"r{i}" for i in range(n)]
    docs = []
    for rid in ids:
        final = data.draw(st.sampled_from([None, "stopped", "terminated", "superseded"]))
        extra: dict[str, Any] = {}
        if final:
            extra["final"] = final
        if final == "superseded":
            extra["superseded_by"] = data.draw(st.sampled_from([*ids, "gone"]))
        docs.append(run(rid, **extra))
    acks = {rid: {"at": T0} for rid in (data.draw(st.sets(st.sampled_from(ids))) if ids else set())}

    def vouched(rid: str, seen: frozenset[str]) -> bool:
        doc = next((d for d in docs if d["run_id"] == rid), None)
        if doc is None or rid in seen:
            return False
        if rid in acks or doc.get("final") in ("stopped", "terminated"):
            return True
        return doc.get("final") == "superseded" and vouched(doc["superseded_by"], seen | {rid})

    expected = bool(docs) and all(vouched(d["run_id"], frozenset()) for d in docs)
    assert ("a" in runs.accounted(["a"], docs, acks)) == expected
