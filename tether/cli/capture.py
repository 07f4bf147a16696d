"""``tether capture export``: the captured flows of an agent, a termination or a time range, as one HAR file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .remote import add_controlplane, client, path_segment
from .sidecar import default_state_root


def add_capture(sub: Any) -> None:
    capture = sub.add_parser("capture", help="traffic captures").add_subparsers(
        dest="capture_command", required=True, metavar="ACTION")
    add_capture_export(capture)


def add_capture_export(sub: Any) -> None:
    p = sub.add_parser("export", help="export captured flows as HAR")
    add_controlplane(p)
    p.add_argument("--agent", help="this agent's calls")
    p.add_argument("--termination", metavar="ID", help="the calls of this termination's record")
    p.add_argument("--since", help="only calls started at or after this time (epoch seconds or ISO 8601)")
    p.add_argument("--until", help="only calls started before this time")
    p.add_argument("--har", required=True, metavar="F", help="the HAR file to write")
    p.add_argument("--captures", default=str(default_state_root()), metavar="DIR",
                   help="where sidecars keep their state dirs (tether run's --state-dir)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from tether.proxy.capture import export, parse_when, selection

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
    har, count, missing = export(root, wanted, calls, since, until)
    for agent in missing:
        print(f"warning: no capture for {agent} under {root}")
    Path(args.har).write_text(json.dumps(har, indent=1))
    print(f"wrote {args.har}: {count} call(s) from {len(wanted) - len(missing)} agent(s), in time order")
    return 0
