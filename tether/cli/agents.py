"""``tether agents`` (the registered agents, or their delegation tree) and ``tether revoke``."""

from __future__ import annotations

import argparse
from typing import Any

from .remote import add_controlplane, client, path_segment, signer_from
from .text import caps_text, print_json


def add_agents(sub: Any) -> None:
    p = sub.add_parser("agents", help="list registered agents")
    add_controlplane(p)
    p.add_argument("--tree", action="store_true", help="show the delegation tree and every sidecar run")
    p.add_argument("--json", action="store_true", help="print the control plane's answer as JSON")
    p.set_defaults(func=cmd_agents)


def add_revoke(sub: Any) -> None:
    p = sub.add_parser("revoke", help="revoke a link (as admin, or as an ancestor principal with --chain/--key)")
    add_controlplane(p)
    p.add_argument("jti", nargs="?", help="the link to revoke (its jti)")
    p.add_argument("--agent", help="revoke every link this agent holds instead")
    p.add_argument("--chain", metavar="F", help="act as the principal holding this chain (needs --key)")
    p.add_argument("--key", metavar="F", help="the private key of --chain's leaf")
    p.add_argument("--reason", default="", help="kept with the revocation")
    p.set_defaults(func=cmd_revoke)


def cmd_revoke(args: argparse.Namespace) -> int:
    from tether.capability.errors import BAD_REQUEST, TetherError

    if args.chain and not args.key:  # checked first: nothing is read or sent for a half-given principal
        raise TetherError("--chain needs --key (the private key of the chain's leaf, the principal's)",
                          code=BAD_REQUEST)
    c = client(args)
    if args.agent:
        result = c.request("POST", f"/v1/agents/{path_segment(args.agent)}/revoke", {"reason": args.reason})
        for doc in result["revoked"]:
            print(f"revoked {doc['jti']} ({doc['agent']}) at {doc['at']:.0f} by {revoker(doc)}")
        return 0
    if not args.jti:
        raise TetherError("give a JTI or --agent ID", code=BAD_REQUEST)
    signer = signer_from(args.chain, args.key) if args.chain else None
    doc = c.request("POST", f"/v1/grants/{path_segment(args.jti)}/revoke", {"reason": args.reason}, signer=signer)
    print(f"revoked {doc['jti']} ({doc['agent']}) by {revoker(doc)}; cut off: {', '.join(doc['agents_cut_off'])}")
    return 0


def cmd_agents(args: argparse.Namespace) -> int:
    data = client(args).request("GET", "/v1/agents")
    if args.json:
        print_json(data)
        return 0
    if not data["agents"]:
        print("no agents registered")
        return 0
    if args.tree:
        for i, root in enumerate(data["tree"]):
            print_tree(root, "", i == len(data["tree"]) - 1, top=True)
        return 0
    print(f"{'AGENT':<20} {'STATUS':<8} {'JTI':<34} {'SIDECAR':<22} CAPABILITIES")
    for a in data["agents"]:
        print(f"{a['agent']:<20} {a['status']:<8} {a['jti']:<34} {_sidecar_text(a['sidecar']):<22} "
              f"{caps_text(a['caps'])}{_revoked_text(a)}")
    return 0


def revoker(revocation: dict) -> str:
    """Who revoked: an operator's name and how they signed in, a principal, or a termination."""
    who = revocation.get("operator")
    return f"{who['operator']} ({who['via']})" if who else revocation["by"]


def _revoked_text(node: dict) -> str:
    if node.get("revoked"):
        return f"  (revoked by {revoker(node['revoked'])})"
    if node.get("revoked_via"):
        return f"  (an ancestor's link {node['revoked_via'][:12]}… is revoked)"
    return ""


def _sidecar_text(sidecar: dict | None) -> str:
    if not sidecar:
        return "no sidecar"
    return f"{sidecar['state']}, lease {sidecar['lease']}"


def _runs_text(node: dict) -> str:
    """Every sidecar run of a link: its real state (serving, draining, terminated, stopped, superseded, lapsed)."""
    runs = node.get("runs") or []
    if len(runs) <= 1:
        return _sidecar_text(node.get("sidecar"))
    return "; ".join(f"{r['run_id']}: {r['state']}" for r in runs)


def print_tree(node: dict, prefix: str, last: bool, top: bool = False) -> None:
    branch = "" if top else ("└── " if last else "├── ")
    status = node["status"].upper() if node["status"] != "active" else "active"
    print(f"{prefix}{branch}{node['agent']}  [{status}] jti {node['jti'][:12]}…  "
          f"{caps_text(node['caps'])}  ({_runs_text(node)}){_revoked_text(node)}")
    child_prefix = prefix + ("" if top else ("    " if last else "│   "))
    for i, child in enumerate(node["children"]):
        print_tree(child, child_prefix, i == len(node["children"]) - 1)
