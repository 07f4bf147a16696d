"""``tether capture``: ``export`` (the captured flows of an agent, a termination or a time range, as one HAR file, read
across every segment, compressed or not) and ``prune`` (the retention policy applied to a state root now)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .remote import add_controlplane, client, path_segment
from .sidecar import SIDECAR_OPTIONS, default_state_root


def add_capture(sub: Any) -> None:
    capture = sub.add_parser("capture", help="traffic captures").add_subparsers(
        dest="capture_command", required=True, metavar="ACTION")
    add_capture_export(capture)
    add_capture_prune(capture)


def _add_captures(p: argparse.ArgumentParser) -> None:
    p.add_argument("--captures", default=str(default_state_root()), metavar="DIR",
                   help="where sidecars keep their state dirs (tether run's --state-dir)")


def add_capture_export(sub: Any) -> None:
    p = sub.add_parser("export", help="export captured flows as HAR", description="Write the captured flows of an "
                       "agent, a termination's record or a time range as one HAR file, in time order, read across "
                       "every capture segment. Exporting a termination releases its hold on the flows its record "
                       "names (they are pruned by the usual retention from then on) unless --keep-hold.")
    add_controlplane(p)
    p.add_argument("--agent", help="this agent's calls")
    p.add_argument("--termination", metavar="ID", help="the calls of this termination's record")
    p.add_argument("--since", help="only calls started at or after this time (epoch seconds or ISO 8601)")
    p.add_argument("--until", help="only calls started before this time")
    p.add_argument("--har", required=True, metavar="F", help="the HAR file to write")
    p.add_argument("--keep-hold", action="store_true",
                   help="with --termination: keep holding the record's flows after the export")
    _add_captures(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from tether.capture.har import collect, parse_when, selection
    from tether.capture.segments import mark_exported

    root = Path(args.captures)
    since, until = parse_when(args.since), parse_when(args.until)
    if not (args.termination or args.agent or since is not None or until is not None):
        raise TetherError("give --agent ID, --termination ID, or a time range (--since/--until)", code=BAD_REQUEST)
    if not root.is_dir():  # an empty HAR would read as "no calls", when the captures are elsewhere
        raise TetherError(f"no captures directory {root} (give --captures DIR: where the sidecars kept their "
                          "state dirs)", code=BAD_REQUEST)
    c = client(args)
    record = c.request("GET", f"/v1/records/{path_segment(args.termination)}") if args.termination else None
    wanted = selection(root, record, args.agent)
    if record is not None:
        calls = record["calls"]
    else:
        query = f"?agent={args.agent}" if args.agent else ""
        calls = c.request("GET", f"/v1/reports{query}")
    done = collect(root, wanted, calls, since, until)
    for agent in done.missing:
        print(f"warning: no capture for {agent} under {root}")
    if done.lost:
        print(f"warning: {done.lost} flow(s) the record names are in no capture segment (pruned, or never written)")
    out = Path(args.har)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(done.har, indent=1))
    tmp.replace(out)  # the HAR is whole before any hold is released
    print(f"wrote {args.har}: {done.entries} call(s) from {len(done.agents)} agent(s), in time order")
    if record is not None and not args.keep_hold:
        released = [a for a in sorted(wanted) if mark_exported(root / a / "captures", record["termination_id"],
                                                                time.time())]
        if released:
            print(f"released the hold of termination {record['termination_id']} on {len(released)} agent(s)' "
                  "captures (pruned by the usual retention from now on)")
    return 0


def _option(dest: str) -> Any:
    return next(o for o in SIDECAR_OPTIONS if o.dest == dest)


def add_capture_prune(sub: Any) -> None:
    p = sub.add_parser("prune", help="apply the capture retention policy now", description="Delete sealed capture "
                       "segments under a state root that the retention policy lets go: older than --keep, over an "
                       "agent's --max-bytes, over --node-max-bytes, or while the disk is under --min-free. A segment "
                       "a termination holds (its record not yet exported, the hold not yet ended) and every active "
                       "segment stay. Sealed segments are compressed and indexed on the way.")
    _add_captures(p)
    p.add_argument("--agent", help="only this agent's captures (the node's cap and the floor still count them all)")
    for flag, dest in (("--max-bytes", "capture_max_bytes"), ("--keep", "capture_keep"),
                       ("--node-max-bytes", "capture_node_max_bytes"), ("--min-free", "capture_min_free")):
        option = _option(dest)
        p.add_argument(flag, dest=dest, default=option.default, metavar=option.metavar,
                       help=f"{option.help} (default {option.default}, the sidecar's --{dest.replace('_', '-')})")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=cmd_prune)


def cmd_prune(args: argparse.Namespace) -> int:
    from tether.capture.maintenance import prune, tidy
    from tether.capture.retention import Policy, parse_duration, parse_size, size_text
    from tether.capture.segments import CAPTURE_FILE, agent_dirs

    root = Path(args.captures)
    if not root.is_dir():
        raise TetherError(f"no captures directory {root} (give --captures DIR: where the sidecars kept their "
                          "state dirs)", code=BAD_REQUEST)
    policy = Policy(max_bytes=parse_size(args.capture_max_bytes), keep_s=parse_duration(args.capture_keep),
                    node_max_bytes=parse_size(args.capture_node_max_bytes),
                    min_free_bytes=parse_size(args.capture_min_free))
    dirs = agent_dirs(root)
    if args.agent is not None and args.agent not in {d.name for d in dirs}:
        raise TetherError(f"no capture for {args.agent} under {root}", code=BAD_REQUEST)
    if not args.dry_run:
        for d in dirs:
            tidy(d / "captures" / CAPTURE_FILE, compress_sealed=True)
    # Every agent under its own cap and age, unless --agent names one (then only it; the node's cap and the floor
    # still weigh every agent).
    own = (args.agent, root / args.agent / "captures" / CAPTURE_FILE) if args.agent else None
    outcome = prune(root, policy, time.time(), own=own, dry_run=args.dry_run)
    decided = outcome.plan
    doc = {"root": str(root), "dry_run": args.dry_run,
           "deleted": [{"agent": s.agent, "segment": Path(s.path).name, "bytes": s.bytes, "why": why}
                       for s, why in decided.delete],
           "freed_bytes": sum(s.bytes for s, _ in decided.delete), "held_segments": decided.held,
           "agents": outcome.agent_bytes, "node_bytes": decided.node_bytes_after, "free_bytes": decided.free_after,
           "disk_low": decided.low, "over": decided.over}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for entry in doc["deleted"]:
        print(f"{verb} {entry['agent']}/captures/{entry['segment']} ({size_text(entry['bytes'])}): {entry['why']}")
    print(f"{verb} {len(doc['deleted'])} segment(s), {size_text(doc['freed_bytes'])}; {decided.held} held by "
          f"terminations; {len(outcome.agent_bytes)} agent(s), {size_text(decided.node_bytes_after)} kept under {root}")
    if decided.free_after is not None:
        print(f"{size_text(decided.free_after)} free" + (" (low: under twice --min-free)" if decided.low else ""))
    for line in decided.over:
        print(f"warning: {line}")
    return 0
