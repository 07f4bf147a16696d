"""The termination protocol as a pure state machine, and the reconciliation record it ends in.

States (docs/contract.md section 6)::

    requested -> draining  -> reconciling -> terminated
    requested -> aborting  -> reconciling -> terminated

``advance`` takes the termination document and the facts the server observed (who acknowledged
quiescence, the time) and returns the next document plus the actions the server must carry out. Every
action is idempotent, so a control plane that dies between an action and the state change simply
repeats it after restart and the protocol still ends in exactly one record.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.capability import keys
from tether.capability.jsonpieces import canonical_json
from tether.capability.report import RECORD_FIELDS
from tether.capability.shared import RESOLUTIONS  # noqa: F401  (the record's resolutions, re-exported)

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
ACTIONS = (REVOKE_SUBTREE, DENY_APPROVALS, SEND_COMMANDS, WRITE_RECORD)  # the driver's one table has each


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


def advance(doc: Doc, acked: Iterable[str], now: float, *, not_before: float = 0.0,
            never_ran: Iterable[str] = ()) -> Step:
    """One step of the protocol. ``acked``: agents whose sidecar runs all acknowledged quiescence.

    ``not_before``: the earliest time an overdue termination may reconcile with agents still silent. A
    control plane that was down past a window gives sidecars a short reconnection grace after it restarts
    (they could not acknowledge while it was away), so one restart with everyone alive gives one record.

    ``never_ran``: agents of the termination with no sidecar run at all. Nothing is waited for from them: no
    call of theirs can be in flight (only a sidecar forwards), and their links are revoked in the first step,
    so no run of theirs can start serving later. The record still lists them unaccounted (nothing confirmed
    them); only the window and grace are not spent waiting for an acknowledgement that cannot come."""
    state = doc["state"]
    if state == REQUESTED:
        nxt = DRAINING if doc["mode"] == "drain" else ABORTING
        return Step(_moved(doc, nxt, now), (REVOKE_SUBTREE, DENY_APPROVALS, SEND_COMMANDS))
    if state in (DRAINING, ABORTING):
        waiting = set(doc["agents"]) - set(acked) - set(never_ran)
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
    """``sha256:`` of the canonical JSON of the record as stored (a record of form 2 served with its segments'
    calls expanded is hashed over its own: ``segments.stored_form``)."""
    from .segments import stored_form

    body = {k: v for k, v in stored_form(record).items() if k not in ("hash", "signature")}
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


def _in_order(reports: list[Doc]) -> list[Doc]:
    return sorted(reports, key=in_order_key)


def call_entry(report: Doc) -> Doc:
    """What a record lists of a reported call (a pure function of the stored report, which never changes)."""
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
    """Assemble (unsigned) what became of every call and agent in the subtree, all in memory.

    ``runs``: every sidecar run of the termination's links; ``acks``: run id -> its acknowledgement of this
    termination; ``starts``: calls whose start the sidecars reported (write-ahead) and whose end never came.
    An agent is terminated only when every one of its runs said so (runs.accounted). ``log``: every record
    written so far; a call one of them holds as reported is not listed again (see ``ownership``).

    The control plane writes a record through ``RecordBuilder`` a page of reports at a time (the calls never
    all in memory); this is the same builder fed with one page, the reference the tests hold it to."""
    builder = RecordBuilder(termination, runs=runs, acks=acks, log=log)
    holders = holders_in(log)
    calls = builder.take(_in_order(reports), holders)
    seen = {call["call_id"] for call in calls} | set(held_as_reported(log))
    header, unknown = builder.finish(record_id=record_id, seen=seen, starts=list(starts), links=links,
                                     revocations=revocations, budgets=budgets, prev_hash=prev_hash, now=now)
    return {**header, "calls": calls + unknown}


# -- a record a page at a time ---------------------------------------------------------------------------
# A termination of an agent with 200,000 calls gives a record of some 60 MB of JSON. The control plane never
# holds it whole: ``RecordBuilder`` takes the termination's reports a page at a time, in the record's order
# (``in_order_key``), with what the log says of each page's calls (``Holders``: the record that holds a call
# as reported, the records that listed it ``unknown``); each page of call entries is encoded and stored as it
# comes, and what the record says of agents, leases and other records (its *header*: every field but
# ``calls``) is small and made at the end. The record's bytes are ``record_pieces(header, entries)``: the same
# canonical JSON a whole record has, so its hash, its signature and ``tether records verify`` are unchanged.
Holders = tuple[str | None, tuple[str, ...]]  # (record holding the call as reported, records listing it unknown)


def in_order_key(report: Mapping[str, Any]) -> tuple[float, str]:
    """The order of a record's calls: by start, then by call id (a store pages reports in this order)."""
    return (report.get("started_at") or 0, report["call_id"])


def holders_in(log: Sequence[Doc]) -> dict[str, Holders]:
    """call id -> its Holders, from whole records (a store answers the same from its index of the log)."""
    owner: dict[str, str] = {}
    unknown: dict[str, list[str]] = {}
    for record in log:
        for call in record.get("calls", ()):
            if call.get("reported", True):
                owner.setdefault(call["call_id"], record["record_id"])
            else:
                listed = unknown.setdefault(call["call_id"], [])
                if record["record_id"] not in listed:
                    listed.append(record["record_id"])
    return {cid: (owner.get(cid), tuple(unknown.get(cid, ()))) for cid in {*owner, *unknown}}


class RecordBuilder:
    """One record (or addendum) built from pages of reports. ``log``: the records so far, oldest first, with
    or without their calls (only their other fields are read: the calls come in as ``Holders``); or, instead,
    ``known``: the headers of some of them with their positions in the log (``Store.log_view``), as many as
    the record's rules read: every record of this termination, every record that left one of ``agents``
    unaccounted, and (``learn``, before each page) every record a page's holders name. The record is the
    same either way: the rules read nothing of any other record."""

    def __init__(self, termination: Doc, *, runs: list[Doc], acks: Mapping[str, Doc], log: Sequence[Doc] = (),
                 agents: Iterable[str] | None = None, late: bool = False,
                 known: Iterable[tuple[int, Doc]] | None = None) -> None:
        self.termination = termination
        self.runs, self.acks = runs, acks
        self.known: dict[str, tuple[int, Doc]] = {}  # record id -> (position in the log, header)
        self.learn(enumerate(log) if known is None else known)
        self.agents = sorted(termination["agents"] if agents is None else agents)
        self.acked = accounted(self.agents, runs, acks)
        entries = [_terminated_entry(self.acked[a]) for a in self.agents if a in self.acked]
        self.terminated = [{**e, "state": "acknowledged_late"} for e in entries] if late else entries
        self.held: dict[str, int] = {}  # record id -> how many of our reports it holds as reported
        self.unknown_there: dict[str, list[str]] = {}  # record id -> calls we report that it listed unknown
        self.foreseen = False
        self.listed = 0

    def learn(self, heads: Iterable[tuple[int, Doc]]) -> None:
        """More records' headers, with their positions in the log."""
        for at, head in heads:
            self.known[head["record_id"]] = (at, head)

    def unknown_ids(self, holders: Mapping[str, Holders]) -> list[str]:
        """The records these holders name that the builder has not learned of (to read before the page)."""
        named = {rid for owner, unknown_in in holders.values() for rid in (owner, *unknown_in) if rid}
        return sorted(named - self.known.keys())

    @property
    def log(self) -> list[Doc]:
        """The headers known, oldest first."""
        return [head for _, head in sorted(self.known.values(), key=lambda item: item[0])]

    def own(self) -> list[Doc]:
        """This termination's records known (all of them: its record and addenda), oldest first."""
        return [head for head in self.log if head.get("termination_id") == self.termination["id"]]

    def _at(self, record_id: str) -> int:
        return self.known[record_id][0]

    def _other(self, record_id: str) -> bool:
        return self.known[record_id][1].get("termination_id") != self.termination["id"]

    def take(self, reports: Iterable[Doc], holders: Mapping[str, Holders]) -> list[Doc]:
        """The call entries of one page of reports (already in order): every report no record holds as
        reported."""
        entries: list[Doc] = []
        for report in reports:
            owner, unknown_in = holders.get(report["call_id"], (None, ()))
            if owner is not None and owner in self.known:
                if self._other(owner):  # this termination's own earlier record: an addendum ``amends`` it
                    self.held[owner] = self.held.get(owner, 0) + 1
                continue
            entries.append(call_entry(report))
            if not self.foreseen:
                self._unknown_there(report["call_id"], unknown_in)
        self.listed += len(entries)
        return entries

    def count(self, staged: Iterable[str], holders: Mapping[str, Holders]) -> None:
        """Account for a page the store staged itself (``Store.stage_reports``): ``staged``, the ids of the calls
        it listed; ``holders``, what the log says of every call of the page it knows (those held as reported
        were left out). The same accounting as ``take``. A holder not in ``log`` is a record appended since
        ``log`` was read: this record's append on the old head fails, and it is built again."""
        for owner, _ in holders.values():
            if owner is not None and owner in self.known and self._other(owner):
                self.held[owner] = self.held.get(owner, 0) + 1
        n = 0
        for call_id in staged:
            n += 1
            if not self.foreseen:
                self._unknown_there(call_id, holders.get(call_id, (None, ()))[1])
        self.listed += n

    def chains(self, chains: Mapping[str, Doc], links: Iterable[str]) -> tuple[list[Doc], dict[str, int]]:
        """Record form 2: of the chains of sealed segments of ``links`` (``Store.chains``), the ones this
        record names (open, non-empty, of one of its agents: ``segments``, sorted by link) and the ones its
        append closes (link -> the seq read; 0 for a link with no chain). The calls of a chain an earlier record
        of another termination closed are held there: counted in ``calls_held_by`` from the chain's count, as
        ``count`` counts calls one by one (a chain this termination's record closed: its addendum ``amends``
        it). A chain closed by a record not in ``known`` was closed since the log was read: this record's
        append fails on the moved head, and it is built again."""
        from .segments import chain_ref

        named: list[Doc] = []
        close: dict[str, int] = {}
        for link in sorted(set(links)):
            chain = chains.get(link)
            if chain is None:
                close[link] = 0
                continue
            owner = chain.get("closed_by")
            if owner is not None:
                if chain["agent"] in self.agents and owner in self.known and self._other(owner) and chain["count"]:
                    self.held[owner] = self.held.get(owner, 0) + chain["count"]
                continue
            if chain["agent"] in self.agents or not chain["seq"]:
                close[link] = chain["seq"]
                if chain["seq"]:
                    named.append(chain_ref(chain))
        return named, close

    def _unknown_there(self, call_id: str, unknown_in: Iterable[str]) -> None:
        for rid in unknown_in:
            if rid in self.known and self._other(rid):
                self.unknown_there.setdefault(rid, []).append(call_id)

    def foresee(self, reports: Iterable[Doc], holders: Mapping[str, Holders]) -> None:
        """Before the pages: of the calls earlier records listed ``unknown``, the reports this record will list
        (``reports``: theirs among this termination's), so ``accounts_for`` is known before the first page.
        It sorts before ``calls`` in the record's canonical JSON, so the hash is taken as the pages are
        staged, with no second pass over them."""
        self.foreseen = True
        for report in reports:
            owner, unknown_in = holders.get(report["call_id"], (None, ()))
            if owner is None or owner not in self.known:
                self._unknown_there(report["call_id"], unknown_in)

    def finish(self, *, record_id: str, seen: Container[str], starts: list[Doc], links: list[Doc],
               revocations: Mapping[str, Doc], budgets: Mapping[str, Doc] | None, prev_hash: str,
               now: float) -> tuple[Doc, list[Doc]]:
        """The record's header (every field but ``calls``) and the ``unknown`` entries that end its calls.
        ``seen``: of the starts and in-flight calls, those this record lists or another record holds as
        reported (never ``unknown`` here)."""
        t = self.termination
        unaccounted, unknown = _unaccounted(self.agents, self.acked, seen, starts, self.runs, self.acks)
        header: Doc = {
            "record_id": record_id,
            "termination_id": t["id"],
            "subject": t["subject"],
            "mode": t["mode"],
            "requested_by": t["requested_by"],
            "operator": t.get("operator"),  # who requested it, and how they signed in (None: a principal)
            "requested_at": t["requested_at"],
            "completed_at": now,
            "window_s": t["window_s"],
            "reason": t.get("reason", ""),
            "leases": _leases(links, revocations, self.runs, self.acked, budgets),
            "agents_terminated": self.terminated,
            "agents_unaccounted": unaccounted,
            "acknowledgements": {e["agent"]: {"at": e["at"], "state": e["state"], "run_id": e["run_id"]}
                                 for e in self.terminated},
            "prev_hash": prev_hash,
        }
        return {**header, **self._ownership()}, unknown

    def _ownership(self) -> Doc:
        """``calls_held_by`` and ``accounts_for`` (see ``ownership``); empty lists are left out."""
        confirmed_runs = {(e["agent"], run) for e in self.terminated for run in e.get("runs", ())}
        accounts: list[Doc] = []
        for record in self.log:
            if record.get("termination_id") == self.termination["id"]:
                continue
            unknown = sorted(set(self.unknown_there.get(record["record_id"], ())))
            agents = sorted({u["agent"] for u in record.get("agents_unaccounted", ())
                             if any((u["agent"], r.get("run_id")) in confirmed_runs for r in u.get("runs", ()))})
            if unknown or agents:
                accounts.append({"record_id": record["record_id"], "termination_id": record.get("termination_id"),
                                 "agents": agents, "call_ids": unknown})
        out: Doc = {}
        if self.held:
            out["calls_held_by"] = [
                {"record_id": rid, "termination_id": self.known[rid][1].get("termination_id"), "calls": n}
                for rid, n in sorted(self.held.items(), key=lambda item: self._at(item[0]))]
        if accounts:
            out["accounts_for"] = accounts
        return out


def record_frame(header: Mapping[str, Any]) -> tuple[str, str]:
    """The canonical JSON of a record whose fields but ``calls`` are ``header``, around its call entries:
    ``frame[0] + ",".join(entries) + frame[1]`` is byte for byte ``canonical_json`` of the whole record
    (as text), each entry being a call entry's own canonical JSON (``encode_entry``), in order."""
    keys = sorted([*header, "calls"])
    cut = keys.index("calls")
    before = [encode_entry(k) + ":" + encode_entry(header[k]) for k in keys[:cut]]
    after = [encode_entry(k) + ":" + encode_entry(header[k]) for k in keys[cut + 1:]]
    return "{" + "".join(b + "," for b in before) + '"calls":[', "]" + "".join("," + a for a in after) + "}"


def record_pieces(header: Mapping[str, Any], entries: Iterable[str]) -> Iterator[str]:
    """``record_frame`` with the entries between, a piece at a time."""
    opening, closing = record_frame(header)
    yield opening
    for i, entry in enumerate(entries):
        yield ("," + entry) if i else entry
    yield closing


def entry_text(report: Doc) -> str:
    """A reported call's entry in a record, as its canonical JSON text: what a store keeps beside each report
    when it arrives, so writing a record copies entries and never encodes one."""
    return encode_entry(call_entry(report))


def encode_entry(value: Any) -> str:
    """One value in the canonical spelling (``capability.jsonpieces.canonical_json``, as text)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def header_hash(header: Mapping[str, Any], entries: Iterable[str]) -> str:
    """``record_hash`` of the record made of ``header`` and ``entries``, without holding it whole."""
    digest = hashlib.sha256()
    body = {k: v for k, v in header.items() if k not in ("hash", "signature")}
    pending: list[str] = []
    for piece in record_pieces(body, entries):
        pending.append(piece)
        if len(pending) >= 512:
            digest.update("".join(pending).encode())
            pending.clear()
    digest.update("".join(pending).encode())
    return "sha256:" + digest.hexdigest()


def key_id_of(signing_key: Any) -> str:
    """What a record's ``key_id`` says of the key that signs it (its RFC 7638 thumbprint)."""
    return keys.thumbprint(signing_key.public_key())


def sign_hash(header: Doc, digest: str, signing_key: Any) -> Doc:
    """The header of a record whose hash is ``digest``, sealed (``seal`` for a record built in pages). The
    header holds its ``key_id`` already (it is hashed)."""
    return {**header, "hash": digest, "signature": keys.b64url(signing_key.sign(digest.encode("ascii")))}


def _unaccounted(agents: list[str], acked: Mapping[str, Doc], seen: Container[str], starts: list[Doc],
                 runs: list[Doc], acks: Mapping[str, Doc]) -> tuple[list[Doc], list[Doc]]:
    """The agents no run of which accounted for, and an ``unknown`` entry for every call last seen in flight
    (or written ahead) and never heard of again. ``seen``: calls the record lists, or another record holds as
    reported (a run that went silent may still list one in flight): never listed as unknown here."""
    listed: set[str] = set()
    unaccounted: list[Doc] = []
    unknown: list[Doc] = []
    never_ended: dict[str, list[Doc]] = {}
    for start in _in_order(starts):
        if start["call_id"] not in seen:
            never_ended.setdefault(start.get("agent", ""), []).append(start)
    for agent in agents:
        known: dict[str, Doc] = {}
        silent = [] if agent in acked else unaccounted_runs(agent, runs, acks)
        for run in silent:
            for call in run.get("inflight") or []:
                if isinstance(call, dict) and call.get("call_id") not in seen and call.get("call_id") not in listed:
                    known.setdefault(call["call_id"], call)
        for start in never_ended.get(agent, []):
            if start["call_id"] not in listed:
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
            listed.add(call["call_id"])
            unknown.append({**{f: call.get(f) for f in RECORD_FIELDS}, "agent": agent, "resolution": "unknown",
                            "status": None, "reported": False})
    return unaccounted, unknown


def inflight_ids(agents: Iterable[str], runs: list[Doc], acks: Mapping[str, Doc]) -> set[str]:
    """The calls the silent runs of these agents last listed in flight (the candidates, with the starts, for
    ``unknown`` entries: ``seen`` is asked of these only)."""
    acked = accounted(list(agents), runs, acks)
    return {call["call_id"] for agent in agents if agent not in acked
            for run in unaccounted_runs(agent, runs, acks)
            for call in run.get("inflight") or [] if isinstance(call, dict) and isinstance(call.get("call_id"), str)}


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
    record = {**record, "key_id": key_id_of(signing_key)}
    digest = record_hash(record)
    signature = keys.b64url(signing_key.sign(digest.encode("ascii")))
    return {**record, "hash": digest, "signature": signature}


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    count: int
    problems: tuple[str, ...]


def verify_records(records: list[Doc], public_key: Any) -> VerifyResult:
    """Check the whole log: each hash, each signature, and each link to the previous record; and, for a record
    of form 2 (as served: ``segments.served``), every segment it names."""
    from .segments import check_served

    result = verify_digests([(record, record_hash(record)) for record in records], public_key)
    problems = list(result.problems) + segment_problems(
        records, lambda index, record, signers: check_served(record, signers), public_key)
    return VerifyResult(not problems, result.count, tuple(problems))


def log_signers(records: Sequence[Mapping[str, Any]], public_key: Any) -> list[dict[str, Any]]:
    """For each record, key id -> public key of every key the log was signed with up to it (a segment is
    signed by the key in force when it was sealed, which may be older than the record's)."""
    from .rotation import signers

    expected, _ = signers(list(records), public_key)
    known: dict[str, Any] = {keys.thumbprint(public_key): public_key}
    out: list[dict[str, Any]] = []
    for key in expected:
        if key is not None:
            known.setdefault(keys.thumbprint(key), key)
        out.append(dict(known))
    return out


def segment_problems(records: Sequence[Mapping[str, Any]], check: Any, public_key: Any) -> list[str]:
    """The problems of the segments the records name (``check(index, record, signers)``), each named by its
    record, and a chain named by two records (a segment belongs to the first record naming it)."""
    problems: list[str] = []
    named: dict[str, str] = {}
    signers_at = log_signers(records, public_key) if any("segments" in r for r in records) else []
    for index, record in enumerate(records):
        if "segments" not in record:
            continue
        rid = record.get("record_id", f"#{index}")
        refs = record.get("segments")
        for ref in refs if isinstance(refs, list) else ():
            if not isinstance(ref, dict):
                continue  # said by ``check`` (a malformed record)
            link = str(ref.get("link"))
            if link in named:
                problems.append(f"record {index} ({rid}): names the chain of link {link[:16]} that record "
                                f"{named[link]} named already")
            named.setdefault(link, str(rid))
        problems += [f"record {index} ({rid}): {p}" for p in check(index, record, signers_at[index])]
    return problems


def verify_digests(records: Sequence[tuple[Mapping[str, Any], str]], public_key: Any) -> VerifyResult:
    """``verify_records`` over (record or its header, the hash of its content as recomputed): a store's log
    is checked a page of calls at a time (``RecordService.verify``)."""
    from cryptography.exceptions import InvalidSignature

    from .rotation import signers

    expected, problems = signers([record for record, _ in records], public_key)
    prev = ""
    seen_ids: set[str] = set()
    for index, (record, digest) in enumerate(records):
        rid = record.get("record_id", f"#{index}")
        if rid in seen_ids:
            problems.append(f"record {index} ({rid}): appears twice")
        seen_ids.add(rid)
        if record.get("prev_hash") != prev:
            problems.append(
                f"record {index} ({rid}): prev_hash does not name record {index - 1} "
                "(a record was removed, inserted or reordered)"
            )
        if record.get("hash") != digest:
            problems.append(f"record {index} ({rid}): content does not match its hash (edited)")
        signer = expected[index]
        try:
            if signer is None:
                raise ValueError
            signer.verify(keys.b64url_decode(record.get("signature", "")), str(record.get("hash", "")).encode())
        except (InvalidSignature, ValueError):
            problems.append(f"record {index} ({rid}): signature does not verify under the control plane key"
                            + (f" in force then ({keys.thumbprint(signer)})" if signer is not None else ""))
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


def late_agents(termination: Doc, log: Sequence[Doc], runs: list[Doc], acks: Mapping[str, Doc]) -> list[str]:
    """The agents this termination's latest record left unaccounted that are accounted for now."""
    latest = [r for r in log if r["termination_id"] == termination["id"]][-1]
    return sorted(accounted([u["agent"] for u in latest["agents_unaccounted"]], runs, acks))


def addendum_header(builder: RecordBuilder, *, record_id: str, prev_hash: str, now: float) -> Doc:
    """Every field of an addendum but ``calls`` (``builder``: made with ``agents=late``, ``late=True``)."""
    t = builder.termination
    earlier = builder.own()
    late = set(builder.agents)
    return {
        "record_id": record_id, "termination_id": t["id"], "subject": t["subject"],
        "mode": t["mode"], "requested_by": t["requested_by"], "operator": t.get("operator"),
        "requested_at": t["requested_at"], "completed_at": now, "window_s": t["window_s"],
        "reason": t.get("reason", ""), "amends": earlier[0]["record_id"],
        "leases": [], "agents_terminated": builder.terminated,
        "agents_unaccounted": [u for u in earlier[-1]["agents_unaccounted"] if u["agent"] not in late],
        "acknowledgements": {e["agent"]: {"at": e["at"], "state": "acknowledged_late", "run_id": e["run_id"]}
                             for e in builder.terminated},
        **builder._ownership(),
        "prev_hash": prev_hash,
    }


def build_addendum(termination: Doc, log: list[Doc], *, record_id: str, reports: list[Doc],
                   runs: list[Doc], acks: Mapping[str, Doc], prev_hash: str, now: float) -> Doc | None:
    """A later record for the same termination, when agents the record could not confirm acknowledge late.

    A sidecar acknowledges only after delivering its last reports, so the addendum can list every call of
    those agents that no earlier record (of this termination or any other) holds as reported, and move the
    agents to ``agents_terminated``. ``log``: every record so far, oldest first (it holds at least this
    termination's record). None when there is nothing to add. (In memory; the control plane builds it a
    page at a time with the same ``RecordBuilder``.)"""
    late = late_agents(termination, log, runs, acks)
    if not late:
        return None
    builder = RecordBuilder(termination, runs=runs, acks=acks, log=log, agents=late, late=True)
    calls = builder.take([r for r in _in_order(reports) if r["agent"] in late], holders_in(log))
    return {**addendum_header(builder, record_id=record_id, prev_hash=prev_hash, now=now), "calls": calls}
