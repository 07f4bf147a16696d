"""CLI commands for the release gate: ``tether audit surface`` (from a control plane, or offline from a
catalog and the grants) and ``tether audit diff`` (exit 1 on any widening)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .remote import add_controlplane, client
from .text import styled


def add_audit(sub: Any) -> None:
    audit = sub.add_parser("audit", help="capability surface and release gates").add_subparsers(
        dest="audit_command", required=True, metavar="ACTION")
    add_audit_surface(audit)
    add_audit_diff(audit)


def add_audit_surface(sub: Any) -> None:
    p = sub.add_parser("surface", help="effective capability list per agent: tier, wire meaning, budget")
    add_controlplane(p)
    p.add_argument("--agent", help="only this agent")
    p.add_argument("--json", action="store_true", help="print the surface as JSON (the input of audit diff)")
    p.add_argument("--catalog", metavar="F",
                   help="offline: compute the surface from this catalog file and the grants below")
    p.add_argument("--chain", action="append", metavar="F",
                   help="offline: a chain file; its leaf's agent holds its caps (repeat)")
    p.add_argument("--trust", metavar="F.pub", help="offline: verify each --chain's signatures against this key")
    p.add_argument("--role", action="append", metavar="AGENT=ROLE", help="offline: AGENT holds the catalog's ROLE")
    p.set_defaults(func=cmd_audit_surface)


def add_audit_diff(sub: Any) -> None:
    p = sub.add_parser("diff", help="exit 1 when any capability widened from OLD to NEW (2: unreadable input)")
    p.add_argument("old", help="the surface before (tether audit surface --json)")
    p.add_argument("new", help="the surface after")
    p.add_argument("--json", action="store_true", help="print the widenings as JSON")
    p.set_defaults(func=cmd_audit_diff)


def cmd_audit_surface(args: argparse.Namespace) -> int:
    if args.catalog:
        doc = offline_surface(args)
    else:
        if args.chain or args.role or args.trust:
            raise TetherError("--chain, --role and --trust go with --catalog (an offline surface)", code=BAD_REQUEST)
        from urllib.parse import quote

        doc = client(args).request("GET", "/v1/audit/surface" + (f"?agent={quote(args.agent, safe='')}"
                                                                 if args.agent else ""))
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    print(f"catalog {doc['catalog']}")
    for agent, caps in sorted(doc["agents"].items()):
        print(f"{agent}:")
        for cap, entry in sorted(caps.items()):
            print(f"  {cap:<32} {entry['tier']:<9} {_wire_text(entry['wire'])}{_budget_text(entry['budget'])}")
    return 0


def offline_surface(args: argparse.Namespace) -> dict[str, Any]:
    """The surface from a catalog file, the leaf of each ``--chain`` and each ``--role AGENT=ROLE``."""
    from tether.capability import keys
    from tether.capability.chain import Verifier, parse_chain_unverified
    from tether.capability.shared import load_catalog, read_chain, read_file
    from tether.controlplane import audit

    catalog = load_catalog(args.catalog)
    verifier = None
    if args.trust:
        verifier = Verifier(keys.load_public(read_file(args.trust, "trust key"), args.trust))
    grants: dict[str, list[Mapping[str, Any]]] = {}
    for path in args.chain or []:
        wire = read_chain(path)
        # Signatures and narrowing only: expiry and revocation are the control plane's to judge, and a
        # chain issued against the catalog under review's predecessor is exactly what is being reviewed.
        links = verifier.structure(wire).links if verifier is not None else parse_chain_unverified(wire)
        grants.setdefault(links[-1].sub, []).append(links[-1].claims["caps"])  # tiers and budgets
    for value in args.role or []:
        agent, sep, role = value.partition("=")
        if not sep or not agent or not role:
            raise TetherError(f"--role {value}: expected AGENT=ROLE", code=BAD_REQUEST)
        grants.setdefault(agent, []).append(catalog.role(role))
    if args.agent is not None:
        if args.agent not in grants:
            raise TetherError(f"no --chain or --role grants anything to {args.agent}", code=BAD_REQUEST)
        grants = {args.agent: grants[args.agent]}
    try:
        return audit.surface(catalog, grants)
    except audit.SurfaceError as exc:
        raise TetherError(str(exc), code=BAD_REQUEST) from None


def _wire_text(wire: Mapping[str, Any]) -> str:
    """A surface's wire (one key: its kind) as its kind prints it (capability/kinds/)."""
    from tether.capability.kinds import KINDS

    ((name, value),) = wire.items()
    return KINDS[name].text(value)


def _budget_text(budget: Mapping[str, Any] | None) -> str:
    if not budget:
        return ""
    limits = (f"{k}={'-' if budget.get(k) is None else budget[k]}" for k in ("calls", "per_minute"))
    return "  budget " + ", ".join(limits)


def cmd_audit_diff(args: argparse.Namespace) -> int:
    from tether.capability.shared import read_file
    from tether.controlplane import audit

    docs = []
    for path in (args.old, args.new):
        try:
            docs.append(json.loads(read_file(path, "surface")))
        except ValueError as exc:
            raise TetherError(f"{path}: not JSON ({exc})", code=BAD_REQUEST) from None
    try:
        found, notes = audit.diff(docs[0], docs[1], old_source=args.old, new_source=args.new)
    except audit.SurfaceError as exc:
        raise TetherError(f"{exc} (give two `tether audit surface --json` files)", code=BAD_REQUEST) from None
    if args.json:
        print(json.dumps({"widened": bool(found), "widenings": [w.to_dict() for w in found], "notes": notes},
                         indent=2, sort_keys=True))
        return 1 if found else 0
    for note in notes:
        print(f"note: {note}")
    for w in found:
        print(f"{styled('WIDENED', 'red', sys.stdout)} {w.line()}")
    if found:
        print(f"{len(found)} widening(s): review before release")
        return 1
    print("no capability widened")
    return 0
