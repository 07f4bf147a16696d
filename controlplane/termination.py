"""The termination protocol as a pure state machine, and the reconciliation record it ends in.

States (DESIGN.md section 6)::

    requested -> draining  -> reconciling -> terminated
    requested -> aborting  -> reconciling -> terminated

``advance`` takes the termination document and the facts the server observed (who acknowledged
quiescence, the time) and returns the next document plus the actions the server must carry out. Every
action is idempotent, so a control plane that dies between an action and the state change simply
repeats it after restart and the protocol still ends in exactly one record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from capability import keys
from capability.jsonpieces import canonical_json
from capability.report import RECORD_FIELDS
from capability.shared import RESOLUTIONS  # noqa: F401  (the record's resolutions, re-exported)

from .runs import accounted, unaccounted_runs

Doc = dict[str, Any]

REQUESTED, DRAINING, ABORTING, RECONCILING, TERMINATED = (
    "requested",
    "draining",
    "aborting",
    "reconciling",
    "terminated",
)
MODES = ("drain", "abort")
TRANSITIONS: Mapping[str, tuple[str, ...]] = {
    REQUESTED: (DRAINING, ABORTING),
    DRAINING: (RECONCILING,),
    ABORTING: (RECONCILING,),
    RECONCILING: (TERMINATED,),
    TERMINATED: (),
}

# Actions the driver performs, each idempotent.
REVOKE_SUBTREE = "revoke_subtree"
DENY_APPROVALS = "deny_approvals"
SEND_COMMANDS = "send_commands"
WRITE_RECORD = "write_record"


class IllegalTransition(Exception):
    pass


@dataclass(frozen=True)
class Step:
    doc: Doc
    actions: tuple[str, ...]


def new_termination(
    termination_id: str,
    subject: str,
    mode: str,
    window_s: float,
    reason: str,
    requested_by: str,
    now: float,
    agents: Iterable[str],
    grace_s: float,
) -> Doc:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    if not 0 <= window_s <= 24 * 3600:
        raise ValueError("window_s must be between 0 and 86400")
    return {
        "id": termination_id,
        "subject": subject,
        "mode": mode,
        "window_s": float(window_s),
        "reason": reason,
        "requested_by": requested_by,
        "requested_at": now,
        "grace_s": float(grace_s),
        "deadline": now + float(window_s),
        "agents": sorted(set(agents)),
        "state": REQUESTED,
        "history": [{"state": REQUESTED, "at": now}],
        "completed_at": None,
        "record_id": None,
        "version": 1,
    }


def _moved(doc: Doc, state: str, now: float, **changes: Any) -> Doc:
    if state not in TRANSITIONS[doc["state"]]:
        raise IllegalTransition(f"{doc['state']} -> {state}")
    return {
        **doc,
        **changes,
        "state": state,
        "version": doc["version"] + 1,
        "history": [*doc["history"], {"state": state, "at": now}],
    }


def advance(doc: Doc, acked: Iterable[str], now: float, *, not_before: float = 0.0) -> Step:
    """One step of the protocol. ``acked``: agents whose sidecar runs all acknowledged quiescence.

    ``not_before``: the earliest time an overdue termination may reconcile with agents still silent. A
    control plane that was down past a window gives sidecars a short reconnection grace after it restarts
    (they could not acknowledge while it was away), so one restart with everyone alive gives one record."""
    state = doc["state"]
    if state == REQUESTED:
        nxt = DRAINING if doc["mode"] == "drain" else ABORTING
        return Step(_moved(doc, nxt, now), (REVOKE_SUBTREE, DENY_APPROVALS, SEND_COMMANDS))
    if state in (DRAINING, ABORTING):
        waiting = set(doc["agents"]) - set(acked)
        if not waiting or now >= max(doc["deadline"] + doc["grace_s"], not_before):
            return Step(_moved(doc, RECONCILING, now), (WRITE_RECORD,))
        return Step(doc, ())
    if state == RECONCILING:
        return Step(doc, (WRITE_RECORD,))
    return Step(doc, ())


def finish(doc: Doc, record_id: str, now: float, unaccounted: Iterable[str] = ()) -> Doc:
    """``unaccounted``: agents the record could not confirm; a late acknowledgement from one of them
    is written as an addendum (see build_addendum)."""
    return _moved(doc, TERMINATED, now, completed_at=now, record_id=record_id, open_agents=sorted(unaccounted))


# -- commands as handed to sidecars --------------------------------------------------------------------
def remaining(command: Doc, now: float) -> float:
    """How long a command's drain window still runs, on the clock of the replica handing it out (which agrees
    with the store's, or it would fix no deadline and drive nothing): a duration a sidecar can count down on
    its own monotonic clock, whatever its wall clock says. The absolute ``deadline`` stays for older sidecars."""
    return round(max(0.0, min(float(command["deadline"]) - now, float(command["window_s"]))), 3)


def delivered(command: Doc | None, now: float) -> Doc | None:
    """A stored command as handed out now (a heartbeat's answer, a resync): its ``remaining_s`` as of now."""
    if not command or "deadline" not in command or "window_s" not in command:
        return command
    return {**command, "remaining_s": remaining(command, now)}


# -- the reconciliation record -----------------------------------------------------------------------
def record_hash(record: Mapping[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k not in ("hash", "signature")}
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


def _in_order(reports: list[Doc]) -> list[Doc]:
    return sorted(reports, key=lambda r: (r.get("started_at") or 0, r["call_id"]))


def _call_entry(report: Doc) -> Doc:
    entry = {f: report.get(f) for f in RECORD_FIELDS}
    for extra in ("ended_at", "code", "termination_id", "run_id", "reissue_of"):
        if report.get(extra) is not None:
            entry[extra] = report[extra]
    return entry


def build_record(
    termination: Doc,
    *,
    record_id: str,
    reports: list[Doc],
    links: list[Doc],
    revocations: Mapping[str, Doc],
    runs: list[Doc],
    acks: Mapping[str, Doc],
    prev_hash: str,
    now: float,
    starts: list[Doc] = (),  # type: ignore[assignment]
    budgets: Mapping[str, Doc] | None = None,  # jti -> {capability: {granted, used, leased, ...}}
    log: Sequence[Doc] = (),
) -> Doc:
    """Assemble (unsigned) what became of every call and agent in the subtree.

    ``runs``: every sidecar run of the termination's links; ``acks``: run id -> its acknowledgement of this
    termination; ``starts``: calls whose start the sidecars reported (write-ahead) and whose end never came.
    An agent is terminated only when every one of its runs said so (runs.accounted). ``log``: every record
    written so far; a call one of them holds as reported is not listed again (see ``ownership``)."""
    acked = accounted(termination["agents"], runs, acks)
    owner = held_as_reported(log)
    calls = [_call_entry(report) for report in _in_order(reports) if report["call_id"] not in owner]
    terminated = [_terminated_entry(acked[a]) for a in sorted(termination["agents"]) if a in acked]
    unaccounted = _unaccounted(termination["agents"], acked, calls, list(starts), runs, acks, set(owner))
    leases = _leases(links, revocations, runs, acked, budgets)
    record = {
        "record_id": record_id,
        "termination_id": termination["id"],
        "subject": termination["subject"],
        "mode": termination["mode"],
        "requested_by": termination["requested_by"],
        "operator": termination.get("operator"),  # who requested it, and how they signed in (None: a principal)
        "requested_at": termination["requested_at"],
        "completed_at": now,
        "window_s": termination["window_s"],
        "reason": termination.get("reason", ""),
        "calls": calls,
        "leases": leases,
        "agents_terminated": terminated,
        "agents_unaccounted": unaccounted,
        "acknowledgements": {e["agent"]: {"at": e["at"], "state": e["state"], "run_id": e["run_id"]}
                             for e in terminated},
        "prev_hash": prev_hash,
    }
    return {**record, **ownership(termination["id"], log, reports, calls, terminated, owner)}


def _unaccounted(agents: list[str], acked: Mapping[str, Doc], calls: list[Doc], starts: list[Doc], runs: list[Doc],
                 acks: Mapping[str, Doc], held: set[str] = frozenset()) -> list[Doc]:  # type: ignore[assignment]
    """The agents no run of which accounted for; appends to ``calls`` every call last seen in flight (or
    written ahead) and never heard of again, as ``unknown``. ``held``: calls another record holds as reported
    (a run that went silent may still list one in flight): never listed as unknown here."""
    seen = {call["call_id"] for call in calls} | set(held)
    unaccounted: list[Doc] = []
    never_ended: dict[str, list[Doc]] = {}
    for start in _in_order(starts):
        if start["call_id"] not in seen:
            never_ended.setdefault(start.get("agent", ""), []).append(start)
    for agent in agents:
        known: dict[str, Doc] = {}
        silent = [] if agent in acked else unaccounted_runs(agent, runs, acks)
        for run in silent:
            for call in run.get("inflight") or []:
                if isinstance(call, dict) and call.get("call_id") not in seen:
                    known.setdefault(call["call_id"], call)
        for start in never_ended.get(agent, []):
            known.setdefault(start["call_id"], start)
        inflight = _in_order(list(known.values()))
        if agent not in acked:
            unaccounted.append(
                {
                    "agent": agent,
                    "last_seen": max((r.get("last_seen") or 0 for r in silent), default=None) or None,
                    "calls_in_flight_last_known": [{f: c.get(f) for f in RECORD_FIELDS} for c in inflight],
                    "lease_expires_at": max((r.get("lease_expires") or 0 for r in silent), default=None) or None,
                    "runs": [{"run_id": r["run_id"], "last_seen": r.get("last_seen"),
                              "lease_expires_at": r.get("lease_expires"), "state": r.get("state")} for r in silent],
                }
            )
        for call in inflight:
            seen.add(call["call_id"])
            calls.append({**{f: call.get(f) for f in RECORD_FIELDS}, "agent": agent, "resolution": "unknown",
                          "status": None, "reported": False})
    return unaccounted


def _leases(links: list[Doc], revocations: Mapping[str, Doc], runs: list[Doc], acked: Mapping[str, Doc],
            budgets: Mapping[str, Doc] | None) -> list[Doc]:
    """How each link ended (revoked or expired), the last lease an unaccounted run held under it, and what
    its subtree spent of its budgets."""
    leases: list[Doc] = []
    lease_of_link: dict[str, float] = {}
    for run in runs:
        if run.get("agent") not in acked and run.get("lease_expires") is not None:
            lease_of_link[run["link"]] = max(lease_of_link.get(run["link"], 0.0), run["lease_expires"])
    for link in sorted(links, key=lambda item: (item.get("registered_at", 0), item["jti"])):
        entry: Doc = {"jti": link["jti"], "agent": link["sub"]}
        revocation = revocations.get(link["jti"])
        exp = link["claims"]["exp"]
        if revocation is not None and revocation["at"] < exp:
            entry["revoked_at"] = revocation["at"]
        else:
            entry["expired_at"] = exp
        if link["hash"] in lease_of_link:
            entry["sidecar_lease_expires_at"] = lease_of_link[link["hash"]]
        if budgets and link["jti"] in budgets:
            entry["budget"] = budgets[link["jti"]]
        leases.append(entry)
    return leases


def _terminated_entry(evidence: Doc) -> Doc:
    """One confirmed agent: the run whose acknowledgement (or goodbye) confirmed it, and all its runs."""
    return {"agent": evidence["agent"], "run_id": evidence["run_id"], "state": evidence["state"],
            "at": evidence["at"], "runs": list(evidence.get("runs", [evidence["run_id"]]))}


def terminated_agents(record: Mapping[str, Any]) -> list[str]:
    """The agent ids a record confirms (entries are objects since runs; strings in older records)."""
    return [e if isinstance(e, str) else e["agent"] for e in record.get("agents_terminated", [])]


def seal(record: Doc, signing_key: Any) -> Doc:
    """Hash the record and sign the hash with the control plane's key; ``key_id`` names that key (its RFC 7638
    thumbprint) so a reader can tell which key a record claims, and a mismatch names both keys."""
    record = {**record, "key_id": keys.thumbprint(signing_key.public_key())}
    digest = record_hash(record)
    signature = keys.b64url(signing_key.sign(digest.encode("ascii")))
    return {**record, "hash": digest, "signature": signature}


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    count: int
    problems: tuple[str, ...]


def verify_records(records: list[Doc], public_key: Any) -> VerifyResult:
    """Check the whole log: each hash, each signature, and each link to the previous record."""
    from cryptography.exceptions import InvalidSignature

    problems: list[str] = []
    prev = ""
    seen_ids: set[str] = set()
    for index, record in enumerate(records):
        rid = record.get("record_id", f"#{index}")
        if rid in seen_ids:
            problems.append(f"record {index} ({rid}): appears twice")
        seen_ids.add(rid)
        if record.get("prev_hash") != prev:
            problems.append(
                f"record {index} ({rid}): prev_hash does not name record {index - 1} "
                "(a record was removed, inserted or reordered)"
            )
        digest = record_hash(record)
        if record.get("hash") != digest:
            problems.append(f"record {index} ({rid}): content does not match its hash (edited)")
        try:
            public_key.verify(keys.b64url_decode(record.get("signature", "")), str(record.get("hash", "")).encode())
        except (InvalidSignature, ValueError):
            problems.append(f"record {index} ({rid}): signature does not verify under the control plane key")
        prev = record.get("hash", "")
    return VerifyResult(not problems, len(records), tuple(problems))


# -- one call, one record: overlapping terminations -------------------------------------------------------
# Terminations overlap: a parent's subtree holds its child, so terminating both at once (or one while the other
# still watches for late acknowledgements) puts the child's calls under two terminations. A call belongs to the
# first record in the log that holds it as reported (a ``calls`` entry without ``reported: false``); every
# later record, of any termination, an addendum included, leaves it out and says where it is. A record that
# reports calls an earlier record of another termination could only list as ``unknown`` (its agent was
# unaccounted there) says so too, naming that record. The log's append is a compare-and-set on its head, so two
# replicas writing at once serialise: the second rebuilds on the first and sees what it holds.
def held_as_reported(log: Sequence[Doc]) -> dict[str, str]:
    """call id -> the record that holds it as reported (the first, oldest first)."""
    owner: dict[str, str] = {}
    for record in log:
        for call in record.get("calls", ()):
            if call.get("reported", True):
                owner.setdefault(call["call_id"], record["record_id"])
    return owner


def ownership(termination_id: str, log: Sequence[Doc], reports: Iterable[Doc], calls: Iterable[Doc],
              terminated: Iterable[Doc], owner: Mapping[str, str] | None = None) -> Doc:
    """What a new record says of the other terminations' records: ``calls_held_by`` (calls of its agents it
    leaves out because an earlier record of another termination holds them as reported: each such record,
    with its termination and how many) and ``accounts_for`` (earlier records of other terminations that listed
    as unaccounted an agent it confirms, or as ``unknown`` a call it reports: each with those agents and call
    ids). An agent counts only through the same sidecar run (an id re-granted since is another agent's run).
    Empty lists are left out, so a record of a termination that overlaps nothing reads as it always did.
    ``owner``: ``held_as_reported(log)``, when the caller has it already."""
    owner = held_as_reported(log) if owner is None else owner
    position = {r["record_id"]: i for i, r in enumerate(log)}
    held: dict[str, int] = {}
    for report in reports:
        rid = owner.get(report["call_id"])
        if rid is not None and log[position[rid]].get("termination_id") != termination_id:  # own: ``amends``
            held[rid] = held.get(rid, 0) + 1
    mine = {c["call_id"] for c in calls if c.get("reported", True)}
    confirmed_runs = {(e["agent"], run) for e in terminated for run in e.get("runs", ())}
    accounts: list[Doc] = []
    for record in log:
        if record.get("termination_id") == termination_id:
            continue  # this termination's own earlier records: an addendum ``amends`` them
        unknown = sorted({c["call_id"] for c in record.get("calls", ()) if c.get("reported", True) is False} & mine)
        agents = sorted({u["agent"] for u in record.get("agents_unaccounted", ())
                         if any((u["agent"], r.get("run_id")) in confirmed_runs for r in u.get("runs", ()))})
        if unknown or agents:
            accounts.append({"record_id": record["record_id"], "termination_id": record.get("termination_id"),
                             "agents": agents, "call_ids": unknown})
    out: Doc = {}
    if held:
        out["calls_held_by"] = [{"record_id": rid, "termination_id": log[position[rid]].get("termination_id"),
                                 "calls": n} for rid, n in sorted(held.items(), key=lambda item: position[item[0]])]
    if accounts:
        out["accounts_for"] = accounts
    return out


def build_addendum(termination: Doc, log: list[Doc], *, record_id: str, reports: list[Doc],
                   runs: list[Doc], acks: Mapping[str, Doc], prev_hash: str, now: float) -> Doc | None:
    """A later record for the same termination, when agents the record could not confirm acknowledge late.

    A sidecar acknowledges only after delivering its last reports, so the addendum can list every call of
    those agents that no earlier record (of this termination or any other) holds as reported, and move the
    agents to ``agents_terminated``. ``log``: every record so far, oldest first (it holds at least this
    termination's record). None when there is nothing to add."""
    earlier = [r for r in log if r["termination_id"] == termination["id"]]
    latest = earlier[-1]
    acked = accounted([u["agent"] for u in latest["agents_unaccounted"]], runs, acks)
    late = sorted(acked)
    if not late:
        return None
    owner = held_as_reported(log)
    theirs = [r for r in _in_order(reports) if r["agent"] in late]
    calls = [_call_entry(r) for r in theirs if r["call_id"] not in owner]
    entries = [{**_terminated_entry(acked[a]), "state": "acknowledged_late"} for a in late]
    return {
        "record_id": record_id, "termination_id": termination["id"], "subject": termination["subject"],
        "mode": termination["mode"], "requested_by": termination["requested_by"],
        "operator": termination.get("operator"),
        "requested_at": termination["requested_at"], "completed_at": now, "window_s": termination["window_s"],
        "reason": termination.get("reason", ""), "amends": earlier[0]["record_id"],
        "calls": calls, "leases": [], "agents_terminated": entries,
        "agents_unaccounted": [u for u in latest["agents_unaccounted"] if u["agent"] not in late],
        "acknowledgements": {e["agent"]: {"at": e["at"], "state": "acknowledged_late", "run_id": e["run_id"]}
                             for e in entries},
        **ownership(termination["id"], log, theirs, calls, entries, owner),
        "prev_hash": prev_hash,
    }
