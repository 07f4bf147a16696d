"""Sidecar runs and agent-id ownership: who may hold an id, and which runs are accounted for. Pure.

Every sidecar start is a *run* (``run_id``, made by the sidecar and named in every request it signs).
Heartbeats, in-flight lists, acknowledgements and the final states below belong to a run of one link,
never to a bare agent id: a second sidecar under the same id (a respawn, a re-grant, an impostor) has
its own runs and can neither answer for nor overwrite another's (docs/contract.md section 10, Identity).

A run reaches a final state only by something it said itself: ``terminated`` (it acknowledged a
termination: it never forwards again), ``stopped`` (its command exited and it said goodbye after its
last reports) or ``superseded`` (a later run on the same state dir, whose lock proves this one is gone,
took over its spool). Anything else is a run the control plane cannot vouch for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tether.capability.protocol import STOPPED, TERMINATED  # the states a run reports of itself

Doc = dict[str, Any]

SUPERSEDED = "superseded"  # the control plane's own final state: a restart on the same state dir took over
FINAL_STATES = (TERMINATED, STOPPED, SUPERSEDED)
LAPSED = "lapsed"  # no final word and no live lease: it cannot forward, but it never said it stopped
CONTROL_PLANE_OWNER = "control-plane"  # the owner of an id whose newest claim is a root grant


def run_state(run: Mapping[str, Any], now: float) -> str:
    """What a run is doing as far as the control plane knows: a final state, else its mode while its lease
    is live, else ``lapsed``."""
    final = run.get("final")
    if final in FINAL_STATES:
        return final
    if (run.get("lease_expires") or 0) <= now:
        return LAPSED
    return str(run.get("state") or "serving")


def run_view(run: Mapping[str, Any], now: float) -> Doc:
    return {
        "run_id": run.get("run_id"),
        "agent": run.get("agent"),
        "link": run.get("link"),
        "state": run_state(run, now),
        "last_seen": run.get("last_seen"),
        "lease_expires": run.get("lease_expires"),
        "lease": "live" if (run.get("lease_expires") or 0) > now and run.get("final") is None else "expired",
        "inflight": len(run.get("inflight") or []),
        "proxy": run.get("proxy"),
        "pid": run.get("pid"),
        "started_at": run.get("started_at"),
        "superseded_by": run.get("superseded_by"),
    }


def _evidence(run: Mapping[str, Any], by_id: Mapping[str, Mapping[str, Any]], acks: Mapping[str, Doc],
              seen: frozenset[str]) -> Doc | None:
    """Why ``run`` can no longer forward, in its own words (or its successor's), or None."""
    rid = run["run_id"]
    ack = acks.get(rid)
    if ack is not None:
        return {"run_id": rid, "at": ack.get("at"), "state": ack.get("state") or TERMINATED}
    final = run.get("final")
    if final in (TERMINATED, STOPPED):
        return {"run_id": rid, "at": run.get("final_at") or run.get("last_seen"), "state": final}
    if final == SUPERSEDED:
        successor = by_id.get(str(run.get("superseded_by")))
        if successor is not None and successor["run_id"] not in seen:
            return _evidence(successor, by_id, acks, seen | {rid})
    return None


def accounted(agents: Iterable[str], runs: Iterable[Mapping[str, Any]], acks: Mapping[str, Doc]) -> dict[str, Doc]:
    """The agents whose every run has said it can no longer forward, with the run that said so last.

    ``runs``: every run of the links in question (a termination's links); ``acks``: run id -> that run's
    acknowledgement of this termination. An agent with no run at all is not accounted for: nothing it
    said confirms it."""
    runs = list(runs)
    by_id = {r["run_id"]: r for r in runs}
    out: dict[str, Doc] = {}
    for agent in agents:
        mine = [r for r in runs if r.get("agent") == agent]
        if not mine:
            continue
        evidence = [_evidence(r, by_id, acks, frozenset()) for r in mine]
        if not all(evidence):
            continue
        proofs = sorted((e for e in evidence if e is not None), key=lambda e: (e["at"] or 0, e["run_id"]))
        last = proofs[-1]
        out[agent] = {"agent": agent, "run_id": last["run_id"], "at": last["at"], "state": last["state"],
                      "runs": sorted({r["run_id"] for r in mine})}
    return out


def unaccounted_runs(agent: str, runs: Iterable[Mapping[str, Any]], acks: Mapping[str, Doc]) -> list[Mapping[str, Any]]:
    runs = list(runs)
    by_id = {r["run_id"]: r for r in runs}
    return [r for r in runs if r.get("agent") == agent and _evidence(r, by_id, acks, frozenset()) is None]


def owner_key(parent_agent: str | None) -> str:
    """The principal an id belongs to: the agent that delegated it first (``agent:ID``), or the control plane
    for an id first (or last) granted at the root.

    The principal is the parent's agent id rather than its key: whoever holds a registered link for that id
    holds it legitimately (its own id is owned the same way, up to the root), and a parent respawned with a
    fresh key, as ``tether run --parent-chain`` does every time, must still be able to respawn its own
    children."""
    return CONTROL_PLANE_OWNER if parent_agent is None else f"agent:{parent_agent}"
