"""Operators' commands: ``tether terminate``, ``terminations``, ``approvals`` and ``records``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tether.capability.errors import USAGE, TetherError
from tether.capability.errors import escape_unprintable as printable

from .remote import add_controlplane, client, path_segment, signer_from
from .text import ago, styled, table
from .text import print_json as _print_json
from .text import when as _when


# -- parsers ---------------------------------------------------------------------------------------------
def add_terminate(sub: Any) -> None:
    p = sub.add_parser("terminate", help="terminate an agent and its whole subtree",
                       description="Terminate an agent and its whole delegation subtree: every link is revoked at "
                       "once, each sidecar drains (in-flight calls may finish within --window) or aborts, "
                       "acknowledges, and a signed reconciliation record says what became of every call. With "
                       "--wait it follows the termination (agents acknowledged, calls in flight, time left in the "
                       "window; on a terminal one line kept current) and prints the record; exit 1 when an agent "
                       "stays unaccounted. Ctrl-C stops following, never the termination.")
    add_controlplane(p)
    p.add_argument("agent", help="the agent whose subtree ends")
    p.add_argument("--mode", choices=["drain", "abort"], default="drain",
                   help="drain: in-flight calls may finish within the window; abort: cut them now")
    p.add_argument("--window", type=float, default=30.0, metavar="S", help="a drain's window in seconds")
    p.add_argument("--reason", default="", help="kept in the record")
    p.add_argument("--chain", metavar="F", help="act as an ancestor principal holding this chain (needs --key)")
    p.add_argument("--key", metavar="F", help="the private key of --chain's leaf")
    p.add_argument("--wait", action="store_true",
                   help="follow it until terminated (progress on stderr) and print the record")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_terminate)


def add_terminations(sub: Any) -> None:
    p = sub.add_parser("terminations", help="show terminations")
    add_controlplane(p)
    p.add_argument("id", nargs="?", help="one termination (default: list them all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_terminations)


def add_approvals(sub: Any) -> None:
    p = sub.add_parser("approvals", help="list, show, approve or deny held calls")
    add_controlplane(p)
    p.add_argument("action", nargs="?", choices=["list", "show", "approve", "deny"], default="list",
                   help="what to do")
    p.add_argument("id", nargs="?", help="the approval (show, approve, deny)")
    p.add_argument("--call-hash", help="approve only if the held call is still this one (from approvals show)")
    p.add_argument("--all", action="store_true", help="list decided ones too")
    p.add_argument("--agent", help="list only this agent's approvals")
    p.add_argument("--origin", choices=["held", "filed"],
                   help="list only calls a sidecar run reports held, or only requests filed without one")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_approvals)


def add_records(sub: Any) -> None:
    p = sub.add_parser("records", help="reconciliation records")
    add_controlplane(p)
    p.add_argument("action", nargs="?", choices=["list", "show", "verify", "checkpoint", "prove", "verify-one"],
                   default="list", help="what to do")
    p.add_argument("id", nargs="?", help="the record (show, prove), or its JSON file (verify-one)")
    p.add_argument("--trust", metavar="F.pub", help="control plane public key (default: fetched from it)")
    p.add_argument("--file", metavar="F", help="verify a JSON list of records saved from /v1/records instead")
    p.add_argument("--checkpoint", metavar="F", help="verify: the log must be exactly the first SIZE records this "
                   "signed checkpoint commits to (exit 1 naming what is wrong); verify-one: the checkpoint")
    p.add_argument("--witness-key", action="append", default=[], metavar="VKEY",
                   help="verify --checkpoint: this witness must have cosigned it (repeat)")
    p.add_argument("--proof", metavar="F", help="verify-one: the inclusion proof (tether records prove ID)")
    p.add_argument("--size", type=int, metavar="N", help="prove: for the log of this size (default: now)")
    p.add_argument("--vkey", action="store_true", help="checkpoint: print the log's verifier key instead")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_records)


# -- commands --------------------------------------------------------------------------------------------
def cmd_terminate(args: argparse.Namespace) -> int:
    c = client(args)
    signer = None
    if bool(args.chain) != bool(args.key):
        raise TetherError("--chain needs --key" if args.chain else "--key goes with --chain", code=USAGE)
    if args.chain:
        signer = signer_from(args.chain, args.key)
    body = {"mode": args.mode, "window_s": args.window, "reason": args.reason}
    doc = c.request("POST", f"/v1/agents/{path_segment(args.agent)}/terminate", body, signer=signer)
    tid = doc["termination_id"]
    if not args.wait:
        if args.json:
            _print_json(doc)
        else:
            print(f"termination {tid}: {args.mode} {args.agent} and {len(doc['agents']) - 1} descendant(s) "
                  f"({', '.join(doc['agents'])}); window {args.window:g}s")
            print(f"follow it with: tether terminations {tid}")
        return 0
    print(f"termination {tid}: {args.mode} of {args.agent} and {len(doc['agents']) - 1} descendant(s), window "
          f"{args.window:g}s", file=sys.stderr, flush=True)
    try:
        follow(c, tid, signer, Progress(sys.stderr))
    except KeyboardInterrupt:
        print(f"tether: stopped following; termination {tid} continues on the control plane (the subtree stays "
              f"revoked and the record is written when it ends): tether terminations {tid}", file=sys.stderr,
              flush=True)
        return 130
    record = c.request("GET", f"/v1/records/{tid}", signer=signer)
    if args.json:
        _print_json(record)
    else:
        print_record_summary(record)
    return 0 if not record["agents_unaccounted"] else 1


def follow(c: Any, tid: str, signer: Any, progress: Progress, every_s: float = 0.3) -> dict:
    """Poll a termination until it is terminated, showing its progress; returns its last view."""
    while True:
        doc = c.request("GET", f"/v1/terminations/{tid}", signer=signer)
        progress.show(doc)
        if doc["state"] == "terminated":
            progress.done()
            return doc
        time.sleep(every_s)


def progress_text(doc: dict) -> str:
    """One termination's progress as one line (under the line naming it): its state, agents acknowledged of all,
    calls in flight, and the time left in the window (then in the grace that follows it)."""
    total = len(doc.get("agents") or [])
    acked = len(doc.get("acknowledged") or [])
    parts = [f"  {doc['state']}: {acked}/{total} agents acknowledged"]
    if doc["state"] in ("draining", "aborting", "requested"):
        parts.append(f"{doc.get('calls_in_flight', 0)} call(s) in flight")
        left = doc.get("remaining_s")
        if left is not None and left > 0:
            parts.append(f"{left:.0f}s left in the {doc['window_s']:g}s window")
        elif doc.get("waiting_for"):
            parts.append(f"window over, waiting up to {doc.get('grace_s', 0):g}s more for "
                         f"{', '.join(doc['waiting_for'])}")
    if doc.get("never_ran") and doc["state"] != "terminated":
        parts.append(f"never ran a sidecar: {', '.join(doc['never_ran'])}")
    return ", ".join(parts)


class Progress:
    """Where ``terminate --wait`` says how it goes: on a terminal one line rewritten in place; elsewhere (a file,
    a pipe, CI's log) a plain line whenever something changes, and at least every ``quiet_s`` while waiting."""

    def __init__(self, stream: Any, quiet_s: float = 5.0) -> None:
        self.stream = stream
        self.live = bool(getattr(stream, "isatty", None) and stream.isatty())
        self.quiet_s = quiet_s
        self.said: tuple | None = None
        self.said_at = 0.0
        self.width = 0

    def show(self, doc: dict) -> None:
        text = progress_text(doc)
        if self.live:
            text = text[:self.columns() - 1]  # a wrapped line cannot be rewritten
            self.stream.write("\r" + text.ljust(self.width) + "\r" + text)  # rewritten: no escape codes needed
            self.width = len(text)
            self.stream.flush()
            return
        changed = (doc["state"], tuple(doc.get("acknowledged") or ()), doc.get("calls_in_flight"))
        if changed != self.said or time.monotonic() - self.said_at >= self.quiet_s:
            print(text, file=self.stream, flush=True)
            self.said, self.said_at = changed, time.monotonic()

    def columns(self) -> int:
        import os

        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError):
            width = 0
        return width if width >= 20 else 80

    def done(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


def cmd_terminations(args: argparse.Namespace) -> int:
    c = client(args)
    if args.id:
        doc = c.request("GET", f"/v1/terminations/{args.id}")
        if args.json:
            _print_json(doc)
            return 0
        print(f"{doc['id']}: {doc['state']} ({doc['mode']} of {doc['subject']}, window {doc['window_s']:g}s)")
        for step in doc["history"]:
            print(f"  {_when(step['at'])}  {step['state']}")
        print(f"  agents: {', '.join(doc['agents'])}")
        print(f"  acknowledged: {', '.join(doc['acknowledged']) or 'none yet'}")
        if doc["waiting_for"] and doc["state"] != "terminated":
            print(f"  waiting for: {', '.join(doc['waiting_for'])}")
            print(f"  calls in flight: {doc.get('calls_in_flight', 0)}; window left: {doc.get('remaining_s', 0):.0f}s")
        if doc.get("never_ran"):
            print(f"  never ran a sidecar (not waited for): {', '.join(doc['never_ran'])}")
        if doc.get("record_id"):
            print(f"  record: {doc['record_id']}  (tether records show {doc['record_id']})")
        return 0
    docs = c.request("GET", "/v1/terminations")
    if args.json:
        _print_json(docs)
        return 0
    if not docs:
        print("no terminations")
        return 0
    rows = [[d["id"], d["state"], d["mode"], d["subject"], f"{d['window_s']:g}s", _when(d["requested_at"]),
             d.get("record_id") or "-"] for d in docs]
    for line in table(["TERMINATION", "STATE", "MODE", "SUBJECT", "WINDOW", "REQUESTED", "RECORD"], rows):
        print(line)
    return 0


def cmd_approvals(args: argparse.Namespace) -> int:
    c = client(args)
    if args.action in ("show", "approve", "deny") and not args.id:
        raise TetherError(f"approvals {args.action} needs the approval's ID (tether approvals lists them)", code=USAGE)
    if args.action == "show":
        doc = c.request("GET", f"/v1/approvals/{args.id}")
        if args.json:
            _print_json(doc)
        else:
            print_approval(doc)
        return 0
    if args.action in ("approve", "deny"):
        body = {"call_hash": args.call_hash} if args.call_hash and args.action == "approve" else {}
        doc = c.request("POST", f"/v1/approvals/{args.id}/{args.action}", body)
        request_line = printable(f"{doc['method']} {doc['url']}", "")
        print(f"{doc['id']}: {doc['status']} ({doc['agent']} {request_line})")
        return 0
    query = {"status": None if args.all else "pending", "agent": args.agent, "origin": args.origin}
    docs = c.request("GET", "/v1/approvals" + _query(query))  # every match: no page is left out
    if args.json:
        _print_json(docs)
        return 0
    if not docs:
        print("no pending approvals" if not args.all else "no approvals")
    for d in docs:
        request_line = printable(f"{d['method']} {d['url']}", "")
        print(f"{d['id']}  {d['status']:<9} {d.get('origin') or '':<5} {printable(d['agent'], ''):<16} "
              f"{printable(str(d['capability']), ''):<28} {request_line}  (asked {ago(d['requested_at'])}"
              f"{decided_text(d)})")
    print_pending_counts(c.request("GET", "/v1/approvals/summary"))
    return 0


def _query(params: dict[str, str | None]) -> str:
    from urllib.parse import urlencode

    given = {k: v for k, v in params.items() if v is not None}
    return "?" + urlencode(given) if given else ""


def print_pending_counts(summary: dict) -> None:
    """How many calls wait, per agent, held calls and filed requests apart: a flood of one agent's requests
    never hides another's held call."""
    if not summary["pending"]:
        return
    print(f"\n{summary['pending']} pending ({summary['held']} held by a sidecar, {summary['filed']} filed "
          "without a held call):")
    for agent, counts in summary["agents"].items():
        print(f"  {printable(agent, ''):<24} {counts['pending']:>5}  ({counts['held']} held, {counts['filed']} filed)")


def _confirmed_text(entry: dict | str, acks: dict) -> str:
    """One confirmed agent and the sidecar run that confirmed it (records before runs hold bare ids)."""
    if isinstance(entry, str):
        return entry + (" (its sidecar had already stopped)" if acks.get(entry, {}).get("state") == "stopped" else "")
    how = {"stopped": ", had already stopped", "acknowledged_late": ", late"}.get(entry.get("state", ""), "")
    return f"{entry['agent']} (run {entry['run_id']}{how})"


def print_approval(doc: dict) -> None:
    """A held call as the approver must see it: who asks, from where in the tree, and the exact request.

    Everything the agent wrote (URL, headers, body) is printed with control characters escaped: a body that
    carries terminal escapes (a carriage return, "erase line", "hidden text") must not show the approver
    another request than the one that would leave."""
    origin = {"held": "  a call its sidecar holds", "filed": "  filed: no sidecar run reports holding this call"}
    print(f"approval {doc['id']}: {doc['status']}  (asked {ago(doc['requested_at'])})"
          + origin.get(doc.get("origin") or "", ""))
    print(f"  agent       {doc['agent']}   chain {' > '.join(doc.get('chain') or [doc['agent']])}")
    print(f"  capability  {doc.get('capability')}")
    print(f"  deciders    {', '.join(doc.get('deciders') or ['admin'])}{decided_text(doc)}")
    req = doc.get("request")
    if not req:
        print(f"  call        {printable(str(doc.get('method')))} {printable(str(doc.get('url')))}  "
              "(the sidecar sent no request details)")
        return
    print(f"  call hash   {req.get('call_hash')}")
    print(f"\n{printable(req['method'], '')} {printable(req['url'], '')}")
    for name, value in req.get("headers", []):
        print(f"{printable(name, '')}: {printable(value, '')}")
    size = req.get("body_size", 0)
    note = f"{size} bytes" + (f", first {len(req.get('body', ''))} shown" if req.get("body_truncated") else ", whole")
    print(f"\n{printable(req.get('body', ''))}" + ("" if req.get("body_encoding") == "text" else "  (base64)"))
    print(f"-- body: {note}")


def by_text(by: str | None, operator: dict | None) -> str:
    """Who decided: an operator's name and how they signed in, a principal, or a termination."""
    if operator:
        return f"{operator['operator']} ({operator['via']})"
    return by or "?"


def decided_text(doc: dict) -> str:
    if not doc.get("decided_at"):
        return ""
    return f"; {doc['status']} by {by_text(doc.get('decided_by'), doc.get('operator'))} at {_when(doc['decided_at'])}"


def print_record_summary(record: dict, all_calls: bool = False) -> None:
    """A responder's view: counts per agent, every call that did not simply complete, and the agents."""
    per_agent: dict[str, dict[str, int]] = {}
    for call in record["calls"]:
        counts = per_agent.setdefault(call["agent"], {})
        counts[call["resolution"]] = counts.get(call["resolution"], 0) + 1
    print(f"record {record['record_id']} for termination {record['termination_id']}"
          + (f" (addendum to {record['amends']}: agents that acknowledged late)" if record.get("amends") else ""))
    requester = by_text(record["requested_by"], record.get("operator"))
    print(f"  {record['mode']} of {record['subject']}, requested by {requester} at "
          f"{_when(record['requested_at'])}, completed {_when(record['completed_at'])}, window {record['window_s']:g}s")
    print(f"  calls: {len(record['calls'])}")
    for agent, counts in sorted(per_agent.items()):
        print(f"    {agent:<14} " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items())))
    listed = [c for c in record["calls"] if all_calls or c["resolution"] != "completed"]
    if listed:
        print("  every call:" if all_calls else "  calls that did not simply complete:")
    for call in listed:
        status = f" {call['status']}" if call.get("status") is not None else ""
        what = call.get("capability") or printable(f"{call['method']} {call['url']}", "")
        code = f" ({call['code']})" if call.get("code") else ""
        print(f"    {call['agent']:<14} {call['resolution']:<18}{status:<5} {what}{code}")
    confirmed = [_confirmed_text(entry, record.get("acknowledgements", {})) for entry in record["agents_terminated"]]
    print(f"  agents terminated (confirmed by their sidecars): {', '.join(confirmed) or 'none'}")
    if record["agents_unaccounted"]:
        print(f"  agents {styled('UNACCOUNTED', 'red', sys.stdout)} (no acknowledgement):")
        for a in record["agents_unaccounted"]:
            print(f"    {a['agent']}: last seen {_when(a['last_seen'])}, "
                  f"{len(a['calls_in_flight_last_known'])} call(s) last known in flight, "
                  f"lease expires {_when(a.get('lease_expires_at'))}")
    revoked = sum(1 for lease in record["leases"] if "revoked_at" in lease)
    print(f"  leases: {revoked} revoked, {len(record['leases']) - revoked} expired")
    print(f"  hash {record['hash']}  prev {record['prev_hash'] or '(first)'}")


def cmd_records(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.shared import read_file
    from tether.controlplane.termination import verify_records

    from . import checkpoints

    c = client(args)
    if args.action == "verify-one":
        return checkpoints.cmd_verify_one(args)
    if args.action == "prove":
        return checkpoints.cmd_prove(args, c)
    if args.action == "checkpoint":
        public = keys.load_public(read_file(args.trust, "trust key"), args.trust) if args.trust else \
            keys.from_jwk(c.request("GET", "/v1/trust", admin=False)["jwk"])
        return checkpoints.cmd_checkpoint(args, c, public)
    if args.action == "verify":
        if args.file:
            records = checkpoints.read_json(args.file, "records", list)  # as saved from /v1/records
        else:
            records = c.request("GET", "/v1/records")
        if args.trust:
            public = keys.load_public(read_file(args.trust, "trust key"), args.trust)
        else:
            public = keys.from_jwk(c.request("GET", "/v1/trust", admin=False)["jwk"])
        result = verify_records(records, public)
        problems = list(result.problems)
        if args.checkpoint:
            note = read_file(args.checkpoint, "checkpoint").decode()
            problems += checkpoints.check_against(records, note, public, args.witness_key)
        if args.json:
            _print_json({"ok": not problems, "records": result.count, "problems": problems,
                         "checkpoint": args.checkpoint, "source": args.file or c.url})
            return 0 if not problems else 1
        for problem in problems:
            print(f"{styled('FAIL', 'red', sys.stdout)} {problem}")
        if not problems:
            against = f"; exactly the log the checkpoint {args.checkpoint} commits to" if args.checkpoint else ""
            print(f"{styled('ok', 'green', sys.stdout)}: {result.count} record(s), hash chain intact, every signature "
                  f"valid{against}")
            return 0
        print(f"the record log does not verify ({len(problems)} problem(s))")
        return 1
    if args.action == "show":
        if not args.id:
            raise TetherError("records show needs the record's ID (tether records lists them)", code=USAGE)
        record = c.request("GET", f"/v1/records/{args.id}")
        if args.json:
            _print_json(record)
        else:
            print_record_summary(record, all_calls=True)
        return 0
    records = c.request("GET", "/v1/records")
    if args.json:
        _print_json(records)
        return 0
    if not records:
        print("no records")
        return 0
    rows = [[r["record_id"], r.get("termination_id") or "-", r.get("mode") or r.get("kind") or "-",
             r.get("subject") or "-", str(len(r.get("calls") or [])), str(len(r.get("agents_unaccounted") or [])),
             _when(r.get("completed_at")), f"addendum to {r['amends']}" if r.get("amends") else ""] for r in records]
    for line in table(["RECORD", "TERMINATION", "MODE", "SUBJECT", "CALLS", "UNACCOUNTED", "COMPLETED", ""], rows):
        print(line)
    return 0
