"""``tether budgets``: the call budgets of a delegation tree, as the control plane counts them."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from .remote import add_controlplane, check_jti, client, path_segment
from .text import print_json


def add_budgets(sub: Any) -> None:
    p = sub.add_parser("budgets", help="call budgets as a tree: granted, used, leased per link")
    add_controlplane(p)
    p.add_argument("--agent", help="only the links this agent holds, and everything below them")
    p.add_argument("--jti", help="one link's subtree (its jti, or a unique prefix of 8+ hex characters)")
    p.add_argument("--json", action="store_true", help="print the control plane's answer as JSON")
    p.set_defaults(func=cmd_budgets)


def cmd_budgets(args: argparse.Namespace) -> int:
    if args.jti:
        data = client(args).request("GET", f"/v1/budgets/{path_segment(check_jti(args.jti))}")
    elif args.agent:
        data = client(args).request("GET", f"/v1/budgets?agent={quote(args.agent, safe='')}")
    else:
        data = client(args).request("GET", "/v1/budgets")
    if args.json:
        print_json(data)
        return 0
    if not data["links"]:
        print("no links registered")
        return 0
    for top in data["links"]:
        for line in tree_lines(top, data.get("window_s", 60)):
            print(line)
    return 0


def tree_lines(node: dict[str, Any], window_s: float, prefix: str = "", last: bool = True,
               top: bool = True) -> list[str]:
    from tether.capability.jti import shown

    branch = "" if top else ("└── " if last else "├── ")
    revoked = "  [REVOKED]" if node.get("revoked") else ""
    lines = [f"{prefix}{branch}{node['agent']}  jti {shown(node['jti'])}{revoked}"]
    inner = prefix + ("" if top else ("    " if last else "│   "))
    for cap, b in sorted(node["budgets"].items()):
        parts = []
        if b.get("granted") is not None:
            parts.append(f"calls {b['used']}/{b['granted']} used, {b['leased']} leased, {b['left']} left")
        if b.get("per_minute") is not None:
            parts.append(f"per_minute {b['per_minute']} (this {b.get('window_s', window_s):g}s window: "
                         f"{b['window_used']} used, {b['window_leased']} leased)")
        lines.append(f"{inner}  {cap}: {'; '.join(parts)}")
    children = node.get("children", [])
    for i, child in enumerate(children):
        lines += tree_lines(child, window_s, inner, i == len(children) - 1, top=False)
    return lines
