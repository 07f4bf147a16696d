"""``tether operators``: add, list, rotate and revoke the named people who decide (an admin's commands), and
``whoami``. A token is printed once, when it is made; the control plane keeps only its hash."""

from __future__ import annotations

import argparse
import re
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .remote import add_controlplane, client, path_segment
from .text import print_json, table, when

ROLES = ("viewer", "approver", "responder", "admin")  # tether/controlplane/auth.py ROLES
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_operators(sub: Any) -> None:
    p = sub.add_parser("operators", help="named operators and their roles (add, list, rotate, revoke, whoami)")
    actions = p.add_subparsers(dest="operators_command", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add an operator; prints its token once")
    add.add_argument("name", help="the person's name, as decisions will carry it (a-z, 0-9, '.', '_', '-')")
    add.add_argument("--role", action="append", choices=ROLES, required=True, dest="roles",
                     help="viewer (read), approver (decide held calls), responder (revoke, terminate), admin "
                          "(everything); repeat for several")
    add.add_argument("--expires", metavar="DURATION", help="the token expires after this long (30d, 12h, 90m, 3600s)")
    rotate = actions.add_parser("rotate", help="a new token for an operator (the old one and its sessions end)")
    rotate.add_argument("name", help="the operator whose token is replaced")
    rotate.add_argument("--expires", metavar="DURATION", help="the new token's lifetime (default: as before)")
    revoke = actions.add_parser("revoke", help="revoke an operator (its token and console sessions stop working)")
    revoke.add_argument("name", help="the operator to revoke")
    listing = actions.add_parser("list", help="the operators, their roles, status and history")
    whoami = actions.add_parser("whoami", help="who TETHER_TOKEN (or TETHER_ADMIN_TOKEN) signs in as")
    for q in (add, rotate, revoke, listing, whoami):
        add_controlplane(q)
        q.add_argument("--json", action="store_true", help="print the control plane's answer as JSON")
        q.set_defaults(func=cmd_operators)


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise TetherError(f"--expires {text!r}: give a duration such as 30d, 12h, 90m or 3600s", code=BAD_REQUEST)
    return float(match.group(1)) * UNITS[match.group(2) or "s"]


def cmd_operators(args: argparse.Namespace) -> int:
    c = client(args)
    action = args.operators_command
    expires = parse_duration(args.expires) if getattr(args, "expires", None) else None
    if action == "add":
        doc = c.request("POST", "/v1/operators", {"name": args.name, "roles": args.roles, "expires_in_s": expires})
    elif action == "rotate":
        doc = c.request("POST", f"/v1/operators/{path_segment(args.name)}/rotate", {"expires_in_s": expires})
    elif action == "revoke":
        doc = c.request("POST", f"/v1/operators/{path_segment(args.name)}/revoke", {})
    elif action == "whoami":
        doc = c.request("GET", "/v1/operators/me")
    else:
        doc = c.request("GET", "/v1/operators")
    if args.json:
        print_json(doc)
        return 0
    if action in ("add", "rotate"):
        print(f"operator {doc['name']} ({', '.join(doc['roles'])}){_expiry(doc)}: its token, shown this once:")
        print(f"    export TETHER_TOKEN={doc['token']}")
    elif action == "revoke":
        print(f"operator {doc['name']} revoked: its token and console sessions no longer work")
    elif action == "whoami":
        print(f"{doc['operator']} ({', '.join(doc['roles'])}), signed in by {doc['via']}")
    else:
        print_list(doc)
    return 0


def print_list(docs: list[dict]) -> None:
    if not docs:
        print("no operators (the bootstrap admin, TETHER_ADMIN_TOKEN, is always one)")
        return
    rows = []
    for d in docs:
        last = d["history"][-1] if d["history"] else None
        change = f"{last['action']} by {last['operator']} ({last['via']}) {when(last['at'])}" if last else ""
        expires = when(d["expires_at"]) if d.get("expires_at") else "never"
        rows.append([d["name"], d["status"], ", ".join(d["roles"]), expires, change])
    for line in table(["NAME", "STATUS", "ROLES", "EXPIRES", "LAST CHANGE"], rows):
        print(line)


def _expiry(doc: dict) -> str:
    return f", expires {when(doc['expires_at'])}" if doc.get("expires_at") else ""
