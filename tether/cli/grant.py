"""``tether keygen`` and ``tether grant issue|delegate|register|verify``: keys and the links of a chain."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from .remote import add_controlplane, client, signer_from
from .text import caps_text

CAP_METAVAR = "NAME=TIER[,calls=N][,per_minute=M]"


# -- parsers ---------------------------------------------------------------------------------------------
def add_keygen(sub: Any) -> None:
    p = sub.add_parser("keygen", help="write an Ed25519 key pair (F and F.pub)")
    p.add_argument("--out", required=True, metavar="F", help="the private key's file (mode 0600); F.pub beside it")
    p.add_argument("--force", action="store_true",
                   help="when F or F.pub exists, keep it as F.replaced-TIME (and F.pub.replaced-TIME) and write a new "
                        "pair (without --force an existing file is refused: tether.file_exists)")
    p.set_defaults(func=cmd_keygen)


def add_grant(sub: Any) -> None:
    grant = sub.add_parser("grant", help="issue, delegate, register and verify grants").add_subparsers(
        dest="grant_command", required=True, metavar="ACTION")
    add_grant_issue(grant)
    add_grant_delegate(grant)
    add_grant_register(grant)
    add_grant_verify(grant)
    add_grant_proof(grant)


def add_grant_issue(sub: Any) -> None:
    p = sub.add_parser("issue", help="issue a root grant (offline with --signing-key, else via the control plane)")
    p.add_argument("--signing-key", metavar="F", help="sign offline with the control plane's key (else: ask it)")
    p.add_argument("--catalog", default="catalog.yaml", metavar="F", help="the catalog (offline issue only)")
    p.add_argument("--agent", required=True, help="the agent id the grant names")
    p.add_argument("--subject-key", required=True, metavar="F.pub", help="the agent's public key")
    p.add_argument("--cap", action="append", metavar=CAP_METAVAR, help="a capability and its tier (repeat)")
    p.add_argument("--role", help="start from a catalog role's capabilities")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="S", help="seconds the grant lives")
    p.add_argument("--depth", type=int, default=3, metavar="N", help="how many delegations may follow")
    p.add_argument("--out", metavar="F", help="write the chain here instead of stdout")
    add_controlplane(p)
    p.set_defaults(func=cmd_grant_issue)


def add_grant_delegate(sub: Any) -> None:
    p = sub.add_parser("delegate", help="delegate a narrower child link under a chain you hold")
    p.add_argument("--chain", required=True, metavar="F", help="the chain you hold")
    p.add_argument("--key", required=True, metavar="F", help="your private key (the chain leaf's subject)")
    p.add_argument("--agent", required=True, help="the child's agent id")
    p.add_argument("--subject-key", required=True, metavar="F.pub", help="the child's public key")
    p.add_argument("--cap", action="append", metavar=CAP_METAVAR, help="a capability and its tier (repeat)")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="S", help="seconds the child link lives")
    p.add_argument("--depth", type=int, default=None, metavar="N",
                   help="how many delegations may follow (default: one less than yours)")
    p.add_argument("--catalog", metavar="F", help="check capability names against this catalog")
    p.add_argument("--out", metavar="F", help="write the chain here instead of stdout")
    p.set_defaults(func=cmd_grant_delegate)


def add_grant_register(sub: Any) -> None:
    p = sub.add_parser("register", help="register a chain with the control plane (proved by its key)")
    p.add_argument("--chain", required=True, metavar="F", help="the chain to register")
    p.add_argument("--key", required=True, metavar="F", help="the chain leaf's private key (the proof)")
    add_controlplane(p)
    p.set_defaults(func=cmd_grant_register)


def add_grant_verify(sub: Any) -> None:
    p = sub.add_parser("verify", help="verify a chain: exit 0 valid, 1 invalid (code printed)")
    p.add_argument("--chain", required=True, metavar="F", help="the chain to verify")
    p.add_argument("--trust", metavar="F.pub", help="verify offline against this control plane key")
    p.add_argument("--revoked", nargs="*", metavar="JTI", help="offline: treat these links as revoked")
    add_controlplane(p, "verify online at this control plane (when --trust is not given)")
    p.set_defaults(func=cmd_grant_verify)


def add_grant_proof(sub: Any) -> None:
    p = sub.add_parser("proof", help="print a Tether-Proof header for one request, signed as the chain's holder",
                       description="Sign one control-plane request as the holder of --chain (what a sidecar does "
                       "for every request it makes) and print the Tether-Proof header's value. A proof is good "
                       "once, within 60 s, for exactly this method, path (with its query) and body: curl -H "
                       "\"Tether-Proof: $(tether grant proof --chain F --key K /v1/events?after=-1)\" "
                       "$TETHER_CONTROLPLANE/v1/events?after=-1")
    p.add_argument("path", help="the request's path and query string, as sent (/v1/events?after=-1)")
    p.add_argument("--chain", required=True, metavar="F", help="the chain you hold")
    p.add_argument("--key", required=True, metavar="F", help="your private key (the chain leaf's subject)")
    p.add_argument("--method", default="GET", help="the request's method")
    p.add_argument("--data", default="", metavar="BODY", help="the request's body, exactly as it will be sent")
    p.set_defaults(func=cmd_grant_proof)


# -- commands --------------------------------------------------------------------------------------------
def cmd_keygen(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.errors import FILE_EXISTS, TetherError
    from tether.capability.shared import publish_file, set_aside, write_secret

    pub = f"{args.out}.pub"
    there = [p for p in (args.out, pub) if Path(p).exists()]
    if there and not args.force:
        raise TetherError(f"{' and '.join(there)} already exist(s): not replacing (a replaced key invalidates every "
                          "chain and record it signed); move it away, or pass --force to keep it beside the new one",
                          code=FILE_EXISTS, path=there[0])
    now = time.time()
    for kept in filter(None, (set_aside(p, now) for p in there)):
        print(f"kept the old {kept.rsplit('.replaced-', 1)[0]} as {kept}", file=sys.stderr)
    key = keys.generate()
    write_secret(args.out, keys.private_pem(key))
    if not publish_file(pub, keys.public_pem(key.public_key()), 0o644):
        raise TetherError(f"{pub} appeared while {args.out} was written: check which process writes keys here",
                          code=FILE_EXISTS, path=pub)
    print(f"wrote {args.out} (private, mode 600) and {pub}; key id {keys.thumbprint(key.public_key())}")
    return 0


def _output_chain(args: argparse.Namespace, wire: str) -> None:
    from tether.capability.chain import parse_chain_unverified

    if args.out:
        Path(args.out).write_text(wire + "\n")
        links = parse_chain_unverified(wire)
        print(f"wrote {args.out}: {len(links)}-link chain for {links[-1].sub}, leaf jti {links[-1].jti}",
              file=sys.stderr)
    else:
        print(wire)


def cmd_grant_issue(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.chain import mint_root
    from tether.capability.shared import load_catalog, parse_caps, read_file

    subject = keys.load_public(read_file(args.subject_key, "subject key"), args.subject_key)
    caps = parse_caps(args.cap)
    if args.signing_key:
        catalog = load_catalog(args.catalog)
        if args.role:
            caps = {**catalog.role(args.role), **caps}
        signing = keys.load_private(read_file(args.signing_key, "signing key"), args.signing_key)
        wire = mint_root(signing, agent=args.agent, subject_key=subject, caps=caps, now=time.time(),
                         ttl_s=args.ttl, depth=args.depth, catalog=catalog)
    else:
        body = {"agent": args.agent, "subject_key": keys.to_jwk(subject), "caps": caps, "ttl_s": args.ttl,
                "depth": args.depth, "role": args.role}
        wire = ",".join(client(args).request("POST", "/v1/grants", body)["chain"])
    _output_chain(args, wire)
    return 0


def cmd_grant_delegate(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.chain import mint_child, parse_chain_unverified
    from tether.capability.shared import load_catalog, parse_caps, read_chain, read_file

    parent_wire = read_chain(args.chain)
    links = parse_chain_unverified(parent_wire)
    key = keys.load_private(read_file(args.key, "key"), args.key)
    subject = keys.load_public(read_file(args.subject_key, "subject key"), args.subject_key)
    catalog = load_catalog(args.catalog) if args.catalog else None
    child = mint_child(links[-1], key, agent=args.agent, subject_key=subject, caps=parse_caps(args.cap),
                       now=time.time(), ttl_s=args.ttl, depth=args.depth, catalog=catalog)
    _output_chain(args, f"{parent_wire},{child}")
    return 0


def cmd_grant_register(args: argparse.Namespace) -> int:
    from tether.capability.shared import read_chain

    wire = read_chain(args.chain)
    result = client(args).request("POST", "/v1/chains/register", {"chain": wire},
                                  signer=signer_from(args.chain, args.key))
    print(f"registered {result['agent']}'s chain ({len(result['jtis'])} links, {result['new']} new)")
    return 0


def cmd_grant_verify(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.chain import LEEWAY_S, Verifier
    from tether.capability.errors import BAD_REQUEST, ChainError, TetherError
    from tether.capability.shared import read_chain, read_file

    wire = read_chain(args.chain)
    if args.controlplane and not args.trust:
        result = client(args).request("POST", "/v1/chains/verify", {"chain": wire}, admin=False)
        if not result["valid"]:
            err = result["error"]
            print(f"invalid: {err['code']} ({err.get('reason', '')}): {err['message']}")
            return 1
        print(f"valid: {result['agent']} holds {caps_text(result['caps'])}; "
              f"registered: {'yes' if result['registered'] else 'no'}")
        return 0
    if not args.trust:
        raise TetherError("give --trust CONTROLPLANE.pub (offline) or --controlplane URL", code=BAD_REQUEST)
    trust = keys.load_public(read_file(args.trust, "trust key"), args.trust)
    try:
        verified = Verifier(trust).verify(wire, now=time.time(), revoked=set(args.revoked or []))
    except ChainError as exc:
        print(f"invalid: {exc.code} ({exc.reason}): {exc.message}")
        return 1
    print(f"valid: {verified.agent} holds {caps_text(verified.leaf.claims['caps'])}; "
          f"expires in {verified.exp - time.time():.0f}s (leeway {LEEWAY_S}s)")
    if args.revoked is None:
        # Offline, the signatures and dates are all that can be checked: say so, or "valid" reads as "usable".
        print("note: offline check: no revocation list was consulted (give --revoked JTI... or --controlplane URL)")
    else:
        print(f"revocation: checked against the {len(set(args.revoked))} jti(s) given with --revoked only")
    return 0


def cmd_grant_proof(args: argparse.Namespace) -> int:
    import time

    from tether.capability.errors import BAD_REQUEST, TetherError
    from tether.capability.proof import make_proof

    from .remote import signer_from

    if not args.path.startswith("/"):
        raise TetherError(f"the path is the request's path from its first /, such as /v1/events?after=-1 (got "
                          f"{args.path!r})", code=BAD_REQUEST)
    signer = signer_from(args.chain, args.key)
    print(make_proof(signer.key, agent=signer.agent, method=args.method, path=args.path,
                     body=args.data.encode(), now=time.time(), link=signer.link))
    return 0
