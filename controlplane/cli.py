"""The ``tether`` command line. Each subcommand is a thin shell over the model, the client or a runner.

Exit codes: 0 success, 1 a negative verdict (invalid chain, widening found, termination incomplete),
2 bad input or a refusal from the control plane (the stable code is printed first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from capability import keys
from capability.budget import read_grant
from capability.catalog import TIERS
from capability.chain import (
    LEEWAY_S,
    Verifier,
    mint_child,
    mint_root,
    parse_chain_unverified,
)
from capability.errors import BAD_REQUEST, ChainError, TetherError
from capability.shared import parse_caps, parse_listen, read_chain, read_file, write_secret

from .client import Client, Signer

Command = Callable[[argparse.Namespace], int]


# -- helpers ---------------------------------------------------------------------------------------




def path_segment(value: str) -> str:
    """An id as one URL path segment: ``/``, ``?``, ``#``, spaces and the rest percent-encoded, so an odd id
    names that id (and gets a clean "not found") instead of another route."""
    segment = quote(value, safe=":")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment  # never a dot segment


def client(args: argparse.Namespace) -> Client:
    return Client(getattr(args, "controlplane", None))


def signer_from(chain_path: str, key_path: str) -> Signer:
    links = parse_chain_unverified(read_chain(chain_path))
    key = keys.load_private(read_file(key_path, "key"), key_path)
    return Signer(agent=links[-1].sub, link=links[-1].hash, key=key)


def emit(args: argparse.Namespace, value: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(value, indent=2, sort_keys=True))
    else:
        print(text)


def ago(ts: float | None) -> str:
    if not ts:
        return "never"
    delta = time.time() - ts
    return f"{delta:.0f}s ago" if delta >= 0 else f"in {-delta:.0f}s"


# -- keys and grants -----------------------------------------------------------------------------------
def cmd_keygen(args: argparse.Namespace) -> int:
    key = keys.generate()
    write_secret(args.out, keys.private_pem(key))
    Path(f"{args.out}.pub").write_bytes(keys.public_pem(key.public_key()))
    print(f"wrote {args.out} (private, mode 600) and {args.out}.pub; key id {keys.thumbprint(key.public_key())}")
    return 0


def _output_chain(args: argparse.Namespace, wire: str) -> None:
    if args.out:
        Path(args.out).write_text(wire + "\n")
        links = parse_chain_unverified(wire)
        print(
            f"wrote {args.out}: {len(links)}-link chain for {links[-1].sub}, leaf jti {links[-1].jti}", file=sys.stderr
        )
    else:
        print(wire)


def cmd_grant_issue(args: argparse.Namespace) -> int:
    from capability.shared import load_catalog

    subject = keys.load_public(read_file(args.subject_key, "subject key"), args.subject_key)
    caps = parse_caps(args.cap)
    if args.signing_key:
        catalog = load_catalog(args.catalog)
        if args.role:
            caps = {**catalog.role(args.role), **caps}
        signing = keys.load_private(read_file(args.signing_key, "signing key"), args.signing_key)
        wire = mint_root(
            signing,
            agent=args.agent,
            subject_key=subject,
            caps=caps,
            now=time.time(),
            ttl_s=args.ttl,
            depth=args.depth,
            catalog=catalog,
        )
    else:
        body = {
            "agent": args.agent,
            "subject_key": keys.to_jwk(subject),
            "caps": caps,
            "ttl_s": args.ttl,
            "depth": args.depth,
            "role": args.role,
        }
        wire = ",".join(client(args).request("POST", "/v1/grants", body)["chain"])
    _output_chain(args, wire)
    return 0


def cmd_grant_delegate(args: argparse.Namespace) -> int:
    parent_wire = read_chain(args.chain)
    links = parse_chain_unverified(parent_wire)
    key = keys.load_private(read_file(args.key, "key"), args.key)
    subject = keys.load_public(read_file(args.subject_key, "subject key"), args.subject_key)
    catalog = None
    if args.catalog:
        from capability.shared import load_catalog

        catalog = load_catalog(args.catalog)
    child = mint_child(
        links[-1],
        key,
        agent=args.agent,
        subject_key=subject,
        caps=parse_caps(args.cap),
        now=time.time(),
        ttl_s=args.ttl,
        depth=args.depth,
        catalog=catalog,
    )
    _output_chain(args, f"{parent_wire},{child}")
    return 0


def cmd_grant_register(args: argparse.Namespace) -> int:
    wire = read_chain(args.chain)
    result = client(args).request(
        "POST", "/v1/chains/register", {"chain": wire}, signer=signer_from(args.chain, args.key)
    )
    print(f"registered {result['agent']}'s chain ({len(result['jtis'])} links, {result['new']} new)")
    return 0


def cmd_grant_verify(args: argparse.Namespace) -> int:
    wire = read_chain(args.chain)
    if args.controlplane and not args.trust:
        result = client(args).request("POST", "/v1/chains/verify", {"chain": wire}, admin=False)
        if not result["valid"]:
            err = result["error"]
            print(f"invalid: {err['code']} ({err.get('reason', '')}): {err['message']}")
            return 1
        print(
            f"valid: {result['agent']} holds {_caps_text(result['caps'])}; "
            f"registered: {'yes' if result['registered'] else 'no'}"
        )
        return 0
    if not args.trust:
        raise TetherError("give --trust CONTROLPLANE.pub (offline) or --controlplane URL", code=BAD_REQUEST)
    trust = keys.load_public(read_file(args.trust, "trust key"), args.trust)
    try:
        verified = Verifier(trust).verify(wire, now=time.time(), revoked=set(args.revoked or []))
    except ChainError as exc:
        print(f"invalid: {exc.code} ({exc.reason}): {exc.message}")
        return 1
    print(
        f"valid: {verified.agent} holds {_caps_text(verified.leaf.claims['caps'])}; "
        f"expires in {verified.exp - time.time():.0f}s "
        f"(leeway {LEEWAY_S}s)"
    )
    if args.revoked is None:
        # Offline, the signatures and dates are all that can be checked: say so, or "valid" reads as "usable".
        print("note: offline check: no revocation list was consulted (give --revoked JTI... or --controlplane URL)")
    else:
        print(f"revocation: checked against the {len(set(args.revoked))} jti(s) given with --revoked only")
    return 0


def _caps_text(caps: dict[str, Any]) -> str:
    """Caps (tiers or budget objects) as ``cap=direct,calls=20, other=approval``."""
    return ", ".join(f"{c}={read_grant(t, tiers=TIERS).text() if isinstance(t, dict) else t}"
                     for c, t in sorted(caps.items())) or "nothing"


# -- control plane -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .serve import admin_token_from_env, build, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = parse_listen(args.listen, 7000)
    cp = build(
        args.store,
        args.catalog,
        args.signing_key,
        admin_token_from_env(),
        lease_ttl_s=args.lease_ttl,
        grace_s=args.grace,
        rate_window_s=args.rate_window,
    )
    asyncio.run(serve(cp, host, port))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    c = client(args)
    if args.agent:
        result = c.request("POST", f"/v1/agents/{path_segment(args.agent)}/revoke", {"reason": args.reason})
        for doc in result["revoked"]:
            print(f"revoked {doc['jti']} ({doc['agent']}) at {doc['at']:.0f} by {doc['by']}")
        return 0
    if not args.jti:
        raise TetherError("give a JTI or --agent ID", code=BAD_REQUEST)
    signer = signer_from(args.chain, args.key) if args.chain else None
    if args.chain and not args.key:
        raise TetherError("--chain needs --key (the principal's private key)", code=BAD_REQUEST)
    doc = c.request("POST", f"/v1/grants/{path_segment(args.jti)}/revoke", {"reason": args.reason}, signer=signer)
    print(f"revoked {doc['jti']} ({doc['agent']}) by {doc['by']}; cut off: {', '.join(doc['agents_cut_off'])}")
    return 0


def cmd_agents(args: argparse.Namespace) -> int:
    data = client(args).request("GET", "/v1/agents")
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    if not data["agents"]:
        print("no agents registered")
        return 0
    if args.tree:
        for i, root in enumerate(data["tree"]):
            _print_tree(root, "", i == len(data["tree"]) - 1, top=True)
        return 0
    print(f"{'AGENT':<20} {'STATUS':<8} {'JTI':<34} {'SIDECAR':<22} CAPABILITIES")
    for a in data["agents"]:
        print(
            f"{a['agent']:<20} {a['status']:<8} {a['jti']:<34} {_sidecar_text(a['sidecar']):<22} "
            f"{_caps_text(a['caps'])}"
        )
    return 0


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


def _print_tree(node: dict, prefix: str, last: bool, top: bool = False) -> None:
    branch = "" if top else ("└── " if last else "├── ")
    status = node["status"].upper() if node["status"] != "active" else "active"
    print(
        f"{prefix}{branch}{node['agent']}  [{status}] jti {node['jti'][:12]}…  "
        f"{_caps_text(node['caps'])}  ({_runs_text(node)})"
    )
    child_prefix = prefix + ("" if top else ("    " if last else "│   "))
    for i, child in enumerate(node["children"]):
        _print_tree(child, child_prefix, i == len(node["children"]) - 1)


# -- parser ---------------------------------------------------------------------------------------------
def _cp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--controlplane",
        default=os.environ.get("TETHER_CONTROLPLANE"),
        help="control plane URL (default $TETHER_CONTROLPLANE or http://127.0.0.1:7000)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description="Make a fleet of AI agents stoppable.")
    parser.add_argument("--version", action="version", version=f"tether {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="the whole story on an embedded store, no setup")
    p.add_argument("--dir", default=None, help="where to keep the demo's files (default: a temp dir)")
    p.add_argument("--fast", action="store_true", help="shorter pauses")
    p.add_argument("--console", action="store_true",
                   help="decide the held call in the web console, and keep the console up at the end")
    p.set_defaults(func=_lazy("controlplane.demo", "cmd_demo"))

    p = sub.add_parser("keygen", help="write an Ed25519 key pair (F and F.pub)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_keygen)

    grant = sub.add_parser("grant", help="issue, delegate, register and verify grants").add_subparsers(
        dest="grant_command", required=True, metavar="ACTION"
    )
    p = grant.add_parser("issue", help="issue a root grant (offline with --signing-key, else via the control plane)")
    p.add_argument("--signing-key")
    p.add_argument("--catalog", default="catalog.yaml")
    p.add_argument("--agent", required=True)
    p.add_argument("--subject-key", required=True)
    p.add_argument("--cap", action="append", metavar="NAME=TIER[,calls=N][,per_minute=M]")
    p.add_argument("--role", help="start from a catalog role's capabilities")
    p.add_argument("--ttl", type=float, default=3600.0)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--out", help="write the chain here instead of stdout")
    _cp_arg(p)
    p.set_defaults(func=cmd_grant_issue)
    p = grant.add_parser("delegate", help="delegate a narrower child link under a chain you hold")
    p.add_argument("--chain", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--subject-key", required=True)
    p.add_argument("--cap", action="append", metavar="NAME=TIER[,calls=N][,per_minute=M]")
    p.add_argument("--ttl", type=float, default=3600.0)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--catalog", help="check capability names against this catalog")
    p.add_argument("--out")
    p.set_defaults(func=cmd_grant_delegate)
    p = grant.add_parser("register", help="register a chain with the control plane (proved by its key)")
    p.add_argument("--chain", required=True)
    p.add_argument("--key", required=True)
    _cp_arg(p)
    p.set_defaults(func=cmd_grant_register)
    p = grant.add_parser("verify", help="verify a chain: exit 0 valid, 1 invalid (code printed)")
    p.add_argument("--chain", required=True)
    p.add_argument("--trust")
    p.add_argument("--revoked", nargs="*")
    _cp_arg(p)
    p.set_defaults(func=cmd_grant_verify)

    cp = sub.add_parser("controlplane", help="run the control plane").add_subparsers(
        dest="cp_command", required=True, metavar="ACTION"
    )
    p = cp.add_parser("serve", help="serve the control plane API")
    p.add_argument("--store", default="sqlite:///tether.db")
    p.add_argument("--listen", default="127.0.0.1:7000")
    p.add_argument("--catalog", default=None,
                   help="the capability catalog (default ./catalog.yaml; without one, everything is absent)")
    p.add_argument("--signing-key", default="tether-signing.key")
    p.add_argument("--lease-ttl", type=float, default=15.0, help="seconds a sidecar may go without contact")
    p.add_argument("--grace", type=float, default=5.0, help="seconds past a drain window before reconciling")
    p.add_argument("--rate-window", type=float, default=None, metavar="S",
                   help="length of the window a per_minute budget counts in (default 60, or TETHER_RATE_WINDOW_S; "
                        "shorter only for tests)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sidecar", help="run one agent's sidecar proxy")
    _cp_arg(p)
    p.add_argument("--chain", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--listen", default="127.0.0.1:8080")
    p.add_argument("--catalog", default=None, help="the catalog (default: fetched from the control plane)")
    p.add_argument("--state-dir", default=None, help="spool, captures and CA (default ./.tether/AGENT)")
    p.add_argument("--upstream-ca", help="trust this CA bundle for upstream TLS (besides the system's)")
    p.add_argument("--redact-field", action="append", default=[], help="JSON field to redact in captures")
    p.add_argument("--approval-timeout", type=float, default=120.0)
    p.add_argument("--allow-uncaptured", action="store_true", help="forward calls whose capture fails")
    p.add_argument("--capture-file", help="where captured flows go (default STATE_DIR/captures/flows.mitm)")
    p.add_argument("--no-capture", action="store_true",
                   help="do not capture traffic (enforcement, tracking and reports only)")
    p.add_argument("--call-timeout", type=float, default=300.0, help="abort a forwarded call after this long")
    p.add_argument("--trust", help="pin the control plane's public key instead of fetching it")
    p.add_argument("--ready-file", help="write the proxy address here once serving")
    p.add_argument("--secret", action="append", default=[], metavar="NAME=env:VAR|NAME=file:PATH",
                   help="a catalog credential's secret (OAuth2: the client secret); only the sidecar reads it")
    p.add_argument("--transparent-listen", metavar="H:P",
                   help="also intercept transparently here (the egress lock's or --isolate's redirect target)")
    p.add_argument("--dns-listen", metavar="H:P", help="answer DNS here: every name resolves to the "
                   "transparent listener's address (used by tether run --isolate)")
    p.set_defaults(func=_lazy("proxy.runner", "cmd_sidecar"))

    p = sub.add_parser("run", help="run a command under a sidecar")
    _cp_arg(p)
    p.add_argument("--chain")
    p.add_argument("--key")
    p.add_argument("--parent-chain")
    p.add_argument("--parent-key")
    p.add_argument("--agent", help="the child's agent id (with --parent-chain)")
    p.add_argument("--cap", action="append", metavar="NAME=TIER[,calls=N][,per_minute=M]")
    p.add_argument("--ttl", type=float, default=3600.0)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--upstream-ca")
    p.add_argument("--approval-timeout", type=float, default=120.0)
    p.add_argument("--secret", action="append", default=[], metavar="NAME=env:VAR|NAME=file:PATH",
                   help="given to the sidecar only; env:VAR is removed from the command's environment")
    p.add_argument("--isolate", action="store_true", help="Linux, root: run the command as --user in its own "
                   "network namespace whose only way out is the sidecar (transparent interception)")
    p.add_argument("--user", default=None, help="the unprivileged user for --isolate (default: nobody)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    p.set_defaults(func=_lazy("proxy.run", "cmd_run"))

    p = sub.add_parser("revoke", help="revoke a link (as admin, or as an ancestor principal with --chain/--key)")
    _cp_arg(p)
    p.add_argument("jti", nargs="?")
    p.add_argument("--agent")
    p.add_argument("--chain", help="act as the principal holding this chain")
    p.add_argument("--key")
    p.add_argument("--reason", default="")
    p.set_defaults(func=cmd_revoke)

    p = sub.add_parser("agents", help="list registered agents")
    _cp_arg(p)
    p.add_argument("--tree", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_agents)

    p = sub.add_parser("budgets", help="call budgets as a tree: granted, used, leased per link")
    _cp_arg(p)
    p.add_argument("--agent", help="only the links this agent holds, and everything below them")
    p.add_argument("--jti", help="one link's subtree")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("controlplane.cli_budgets", "cmd_budgets"))

    p = sub.add_parser("terminate", help="terminate an agent and its whole subtree")
    _cp_arg(p)
    p.add_argument("agent")
    p.add_argument("--mode", choices=["drain", "abort"], default="drain")
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--reason", default="")
    p.add_argument("--chain", help="act as an ancestor principal holding this chain")
    p.add_argument("--key")
    p.add_argument("--wait", action="store_true", help="wait until terminated and print the record")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("controlplane.cli_ops", "cmd_terminate"))

    p = sub.add_parser("terminations", help="show terminations")
    _cp_arg(p)
    p.add_argument("id", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("controlplane.cli_ops", "cmd_terminations"))

    p = sub.add_parser("approvals", help="list, show, approve or deny held calls")
    _cp_arg(p)
    p.add_argument("action", nargs="?", choices=["list", "show", "approve", "deny"], default="list")
    p.add_argument("id", nargs="?")
    p.add_argument("--call-hash", help="approve only if the held call is still this one (from approvals show)")
    p.add_argument("--all", action="store_true", help="list decided ones too")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("controlplane.cli_ops", "cmd_approvals"))

    p = sub.add_parser("records", help="reconciliation records")
    _cp_arg(p)
    p.add_argument("action", nargs="?", choices=["list", "show", "verify"], default="list")
    p.add_argument("id", nargs="?")
    p.add_argument("--trust", help="control plane public key (default: fetched from the control plane)")
    p.add_argument("--file", help="verify a JSON list of records saved from /v1/records instead")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("controlplane.cli_ops", "cmd_records"))

    audit = sub.add_parser("audit", help="capability surface and release gates").add_subparsers(
        dest="audit_command", required=True, metavar="ACTION"
    )
    p = audit.add_parser("surface", help="effective capability list per agent: tier, wire meaning, budget")
    _cp_arg(p)
    p.add_argument("--agent", help="only this agent")
    p.add_argument("--json", action="store_true")
    p.add_argument("--catalog", help="offline: compute the surface from this catalog file and the grants below")
    p.add_argument("--chain", action="append", help="offline: a chain file; its leaf's agent holds its caps (repeat)")
    p.add_argument("--trust", help="offline: verify each --chain's signatures against this control plane key")
    p.add_argument("--role", action="append", metavar="AGENT=ROLE", help="offline: AGENT holds the catalog's ROLE")
    p.set_defaults(func=_lazy("controlplane.cli_audit", "cmd_audit_surface"))
    p = audit.add_parser("diff", help="exit 1 when any capability widened from OLD to NEW (2: unreadable input)")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("controlplane.cli_audit", "cmd_audit_diff"))

    capture = sub.add_parser("capture", help="traffic captures").add_subparsers(
        dest="capture_command", required=True, metavar="ACTION"
    )
    p = capture.add_parser("export", help="export captured flows as HAR")
    _cp_arg(p)
    p.add_argument("--agent")
    p.add_argument("--termination")
    p.add_argument("--since", help="only calls started at or after this time (epoch seconds or ISO 8601)")
    p.add_argument("--until", help="only calls started before this time")
    p.add_argument("--har", required=True)
    p.add_argument("--captures", default=".tether", help="where sidecars keep their state dirs")
    p.set_defaults(func=_lazy("proxy.capture", "cmd_export"))
    return parser


def _lazy(module: str, name: str) -> Command:
    """Import heavy subcommands (mitmproxy) only when they run."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(args)

    return run


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tether")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TetherError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tether records show ID | head`: the reader left, nothing is wrong
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return 141


if __name__ == "__main__":
    sys.exit(main())
