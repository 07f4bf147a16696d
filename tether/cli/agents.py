"""``tether agents`` (the registered agents, or their delegation tree) and ``tether revoke``."""

from __future__ import annotations

import argparse
from typing import Any

from .remote import add_controlplane, check_jti, client, path_segment, signer_from
from .text import caps_text, iso, print_json, table


def add_agents(sub: Any) -> None:
    p = sub.add_parser("agents", help="list registered agents (or their delegation tree)",
                       description="Every registered link: its agent, status, jti, latest sidecar run and what it "
                       "holds. --tree shows the delegation tree with each sidecar run; the jti printed (a prefix of "
                       "12 hex characters) is accepted wherever a jti is taken, e.g. tether revoke JTI.")
    add_controlplane(p)
    p.add_argument("--tree", action="store_true", help="show the delegation tree and every sidecar run")
    p.add_argument("--json", action="store_true", help="print the control plane's answer as JSON")
    p.set_defaults(func=cmd_agents)


def add_revoke(sub: Any) -> None:
    p = sub.add_parser("revoke", help="revoke a link (as admin, or as an ancestor principal with --chain/--key)",
                       description="Revoke one link by its jti (or a unique prefix of at least 8 hex characters, as "
                       "tether agents --tree prints it), or with --agent every link an agent holds. As an operator "
                       "(TETHER_TOKEN or TETHER_ADMIN_TOKEN), or as an ancestor principal with --chain and --key: "
                       "then the request is signed with that key, no token is sent, and only links below that "
                       "chain are revoked.")
    add_controlplane(p)
    p.add_argument("jti", nargs="?", help="the link to revoke: its jti, or a unique prefix of 8+ hex characters")
    p.add_argument("--agent", help="revoke every link this agent holds instead (with --chain: every one below it)")
    p.add_argument("--chain", metavar="F", help="act as the principal holding this chain (needs --key)")
    p.add_argument("--key", metavar="F", help="the private key of --chain's leaf")
    p.add_argument("--reason", default="", help="kept with the revocation")
    p.add_argument("--json", action="store_true", help="print the control plane's answer as JSON")
    p.set_defaults(func=cmd_revoke)


def cmd_revoke(args: argparse.Namespace) -> int:
    from tether.capability.errors import USAGE, TetherError

    # checked first: nothing is read or sent for a half-given principal or a jti that names no link
    if bool(args.chain) != bool(args.key):
        raise TetherError("--chain needs --key (the private key of the chain's leaf, the principal's)" if args.chain
                          else "--key goes with --chain (the chain whose leaf it signs for)", code=USAGE)
    if bool(args.jti) == bool(args.agent):
        raise TetherError("give a JTI or --agent ID (one of them)", code=USAGE)
    jti = check_jti(args.jti) if args.jti else None
    c = client(args)
    # As a principal, the request is signed with the chain's key and carries no token: an operator's token in the
    # environment never stands in for the principal it was asked to act as.
    signer = signer_from(args.chain, args.key) if args.chain else None
    if args.agent:
        result = c.request("POST", f"/v1/agents/{path_segment(args.agent)}/revoke", {"reason": args.reason},
                           signer=signer)
        if args.json:
            print_json(result)
            return 0
        for doc in result["revoked"]:
            print(f"revoked {doc['jti']} ({doc['agent']}) at {iso(doc['at'])} by {revoker(doc)}")
        return 0
    doc = c.request("POST", f"/v1/grants/{path_segment(str(jti))}/revoke", {"reason": args.reason}, signer=signer)
    if args.json:
        print_json(doc)
        return 0
    print(f"revoked {doc['jti']} ({doc['agent']}) at {iso(doc['at'])} by {revoker(doc)}; cut off: "
          f"{', '.join(doc['agents_cut_off'])}")
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
    rows = [[a["agent"], a["status"], a["jti"], _sidecar_text(a["sidecar"]), iso(a["exp"]),
             caps_text(a["caps"]) + _revoked_text(a)] for a in data["agents"]]
    for line in table(["AGENT", "STATUS", "JTI", "SIDECAR", "EXPIRES", "CAPABILITIES"], rows):
        print(line)
    return 0


def revoker(revocation: dict) -> str:
    """Who revoked: an operator's name and how they signed in, a principal, or a termination."""
    who = revocation.get("operator")
    return f"{who['operator']} ({who['via']})" if who else revocation["by"]


def _revoked_text(node: dict) -> str:
    from tether.capability.jti import shown

    if node.get("revoked"):
        return f"  (revoked by {revoker(node['revoked'])} at {iso(node['revoked'].get('at'))})"
    if node.get("revoked_via"):
        return f"  (an ancestor's link {shown(node['revoked_via'])} is revoked)"
    return ""


def _sidecar_text(sidecar: dict | None) -> str:
    if not sidecar:
        return "no sidecar"
    inflight = f", {sidecar['inflight']} in flight" if sidecar.get("inflight") else ""
    return f"{sidecar['state']}, lease {sidecar['lease']}{inflight}"


def _runs_text(node: dict) -> str:
    """Every sidecar run of a link: its real state (serving, draining, terminated, stopped, superseded, lapsed)."""
    runs = node.get("runs") or []
    if len(runs) <= 1:
        return _sidecar_text(node.get("sidecar"))
    return "; ".join(f"{r['run_id']}: {r['state']}" for r in runs)


def print_tree(node: dict, prefix: str, last: bool, top: bool = False) -> None:
    from tether.capability.jti import shown

    branch = "" if top else ("└── " if last else "├── ")
    status = node["status"].upper() if node["status"] != "active" else "active"
    print(f"{prefix}{branch}{node['agent']}  [{status}] jti {shown(node['jti'])}  "
          f"{caps_text(node['caps'])}  ({_runs_text(node)}){_revoked_text(node)}")
    child_prefix = prefix + ("" if top else ("    " if last else "│   "))
    for i, child in enumerate(node["children"]):
        print_tree(child, child_prefix, i == len(node["children"]) - 1)
