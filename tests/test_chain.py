"""Grant links and chains: every way a chain can be bad, minting, caching, and request proofs.

Hostile links are built by hand (base64url + JSON + an Ed25519 or HMAC signature) because the mint
functions refuse to produce them. Each row of the table names the exact exception type, code, reason
and link index the verifier must answer with.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import (
    CONTROLPLANE_PRINCIPAL,
    GRANT_TYP,
    LEEWAY_S,
    MAX_LINKS,
    Link,
    VerifiedChain,
    Verifier,
    link_hash,
    mint_child,
    mint_root,
    parse_chain_unverified,
    parse_link,
)
from tether.capability.errors import (
    CHAIN_EXPIRED,
    CHAIN_INVALID,
    CHAIN_REVOKED,
    UNAUTHORIZED,
    ApiError,
    ChainError,
    ChainExpired,
    ChainInvalid,
    ChainRevoked,
    UnknownCapability,
)
from tether.capability.proof import check_proof, make_proof, read_proof

CATALOG = parse_catalog(
    "capabilities:\n"
    "  a.read:  {http: {host: a.example, methods: [GET], path: '/*'}}\n"
    "  a.write: {http: {host: a.example, methods: [POST], path: '/*'}}\n"
    "  b.send:  {mcp: {url: 'http://b.internal:8000/mcp', tool: send}}\n"
    "  c.call:  {http: {host: c.example, methods: [GET, POST], path: '/v1/*'}}\n",
    "test-catalog.yaml",
)
T0 = 1_750_000_000
NOW = T0 + 10
CP = keys.generate()


# -- building links by hand --------------------------------------------------------------------------
def enc(value: Any) -> str:
    raw = value if isinstance(value, bytes) else json.dumps(value, separators=(",", ":")).encode()
    return keys.b64url(raw)


def forge(claims: Any, key: Ed25519PrivateKey | None, header: Any = None, signature: bytes | None = None) -> str:
    """A compact JWS with exactly the header and claims given, signed by ``key`` (or carrying ``signature``)."""
    header = {"alg": "EdDSA", "typ": GRANT_TYP} if header is None else header
    signing_input = f"{enc(header)}.{enc(claims)}"
    if signature is None:
        assert key is not None
        signature = key.sign(signing_input.encode())
    return f"{signing_input}.{keys.b64url(signature)}"


@dataclass
class Node:
    compact: str
    key: Ed25519PrivateKey  # the subject's private key: it signs the next link

    @property
    def link(self) -> Link:
        return parse_link(self.compact)

    @property
    def claims(self) -> dict[str, Any]:
        return dict(self.link.claims)


def child_claims(parent: Node, subject: Ed25519PrivateKey, **override: Any) -> dict[str, Any]:
    """The claims mint_child would write, with ``override`` applied (a value of None removes the claim)."""
    p = parent.link
    claims: dict[str, Any] = {
        "iss": p.sub,
        "sub": f"{p.sub}.child",
        "jti": keys.b64url(hashlib.sha256(subject.public_key().public_bytes_raw()).digest())[:32],
        "iat": T0,
        "nbf": p.nbf,
        "exp": p.exp,
        "prf": p.hash,
        "cnf": {"jwk": keys.to_jwk(subject.public_key())},
        "caps": dict(p.caps),
        "dpth": p.dpth - 1,
        "cat": p.cat,
    }
    claims.update(override)
    return {k: v for k, v in claims.items() if v is not None}


def forge_child(parent: Node, signer: Ed25519PrivateKey | None = None, **override: Any) -> Node:
    subject = keys.generate()
    claims = child_claims(parent, subject, **override)
    return Node(forge(claims, signer or parent.key), subject)


def root_claims(subject: Ed25519PrivateKey, **override: Any) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "iss": CONTROLPLANE_PRINCIPAL,
        "sub": "agent-a",
        "jti": "a" * 32,
        "iat": T0,
        "nbf": T0,
        "exp": T0 + 3600,
        "cnf": {"jwk": keys.to_jwk(subject.public_key())},
        "caps": {"a.read": "direct", "a.write": "approval", "b.send": "direct"},
        "dpth": 3,
        "cat": CATALOG.hash,
    }
    claims.update(override)
    return {k: v for k, v in claims.items() if v is not None}


def forge_root(signer: Ed25519PrivateKey = CP, header: Any = None, **override: Any) -> Node:
    subject = keys.generate()
    return Node(forge(root_claims(subject, **override), signer, header), subject)


def wire(*nodes: Node) -> str:
    return ",".join(n.compact for n in nodes)


@dataclass
class Good:
    """One valid four-link chain, minted the ordinary way: cp -> A -> B -> C -> D."""

    nodes: list[Node]

    @property
    def wire(self) -> str:
        return wire(*self.nodes)


def mint_good() -> Good:
    ka, kb, kc, kd = (keys.generate() for _ in range(4))
    root = Node(mint_root(CP, agent="agent-a", subject_key=ka.public_key(),
                          caps={"a.read": "direct", "a.write": "approval", "b.send": "direct"},
                          now=T0, ttl_s=3600, depth=3, catalog=CATALOG), ka)
    b = Node(mint_child(root.link, ka, agent="agent-b", subject_key=kb.public_key(),
                        caps={"a.read": "direct", "a.write": "approval"}, now=T0, ttl_s=1800), kb)
    c = Node(mint_child(b.link, kb, agent="agent-c", subject_key=kc.public_key(),
                        caps={"a.read": "approval", "a.write": "approval"}, now=T0, ttl_s=900), kc)
    d = Node(mint_child(c.link, kc, agent="agent-d", subject_key=kd.public_key(),
                        caps={"a.read": "approval"}, now=T0, ttl_s=600), kd)
    return Good([root, b, c, d])


GOOD = mint_good()
ROOT, B, C, D = GOOD.nodes


# -- the table -----------------------------------------------------------------------------------------
@dataclass
class Attempt:
    wire: str
    now: float = NOW
    revoked: frozenset[str] = frozenset()
    verifier: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bad:
    id: str
    make: Callable[[], Attempt | str]
    exc: type[Exception]
    reason: str
    link: int | None

    @property
    def code(self) -> str:
        return {ChainInvalid: CHAIN_INVALID, ChainRevoked: CHAIN_REVOKED, ChainExpired: CHAIN_EXPIRED}[self.exc]


def hs256_with_public_key(secret: bytes) -> str:
    header = enc({"alg": "HS256", "typ": GRANT_TYP})
    payload = enc(root_claims(keys.generate()))
    mac = hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{keys.b64url(mac)}"


def swap_last_sig_char(compact: str) -> str:
    """The same signature bytes, spelled differently: the unused low bits of the last base64 character."""
    head, sig = compact.rsplit(".", 1)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(sig[-1])
    other = sig[:-1] + alphabet[last ^ 1]
    assert keys.b64url_decode(other) == keys.b64url_decode(sig)
    return f"{head}.{other}"


def stray_sig_chars(compact: str) -> str:
    """The same signature bytes with junk the lenient decoder skips: another wire form, another link hash."""
    head, sig = compact.rsplit(".", 1)
    other = sig[:40] + "!$!$" + sig[40:]
    assert keys.b64url_decode(other) == keys.b64url_decode(sig)
    return f"{head}.{other}"


def std_alphabet_sig() -> str:
    """Signature bytes whose base64url has '-' and '_', spelled with '+' and '/': the decoder takes both."""
    compact = forge(root_claims(CP), None, signature=b"\xfb\xff" * 32)
    head, sig = compact.rsplit(".", 1)
    assert "-" in sig and "_" in sig
    other = sig.replace("-", "+").replace("_", "/")
    assert keys.b64url_decode(other) == keys.b64url_decode(sig)
    return f"{head}.{other}"


def padded_sig(compact: str) -> str:
    head, sig = compact.rsplit(".", 1)
    assert keys.b64url_decode(sig + "==") == keys.b64url_decode(sig)
    return f"{head}.{sig}=="


def self_delegation() -> str:
    """A child that keeps its parent's key and name: repeating it is a cycle whose signatures all verify."""
    twin = Node(mint_child(ROOT.link, ROOT.key, agent="agent-a", subject_key=ROOT.key.public_key(),
                           caps={"a.read": "direct"}, now=T0, ttl_s=60), ROOT.key)
    return wire(ROOT, twin, twin)


def jti_reuse() -> str:
    child = forge_child(ROOT, jti=ROOT.link.jti)
    return wire(ROOT, child)


def broken_form(claims_patch: dict[str, Any]) -> Callable[[], str]:
    def make() -> str:
        return forge_root(**claims_patch).compact
    return make


def dpth_huge() -> str:
    """A 5000-digit integer: Python's JSON parser refuses it (int max str digits); that must read as malformed."""
    body = json.dumps(root_claims(CP)).replace('"dpth": 3', '"dpth": ' + "9" * 5000)
    assert "9" * 5000 in body
    return forge(body.encode(), CP)


def deep_json() -> str:
    header = enc({"alg": "EdDSA", "typ": GRANT_TYP})
    return f"{header}.{enc(b'[' * 5000)}.{keys.b64url(bytes(64))}"


BAD: list[Bad] = [
    # form
    Bad("empty-chain", lambda: "", ChainInvalid, "malformed", None),
    Bad("blank-chain", lambda: "  ", ChainInvalid, "malformed", None),
    Bad("empty-link", lambda: ROOT.compact + ",", ChainInvalid, "malformed", 1),
    Bad("two-parts", lambda: "eyJhbGciOiJFZERTQSJ9.e30", ChainInvalid, "malformed", 0),
    Bad("four-parts", lambda: ROOT.compact + ".AAAA", ChainInvalid, "malformed", 0),
    Bad("empty-signature-part", lambda: ROOT.compact.rsplit(".", 1)[0] + ".", ChainInvalid, "malformed", 0),
    Bad("bad-base64-header", lambda: "@@@@." + ROOT.compact.split(".", 1)[1], ChainInvalid, "malformed", 0),
    Bad("payload-not-json", lambda: forge(b"not json", CP), ChainInvalid, "malformed", 0),
    Bad("header-not-json", lambda: f"{enc(b'{alg')}.{enc(root_claims(CP))}.{keys.b64url(bytes(64))}",
        ChainInvalid, "malformed", 0),
    Bad("header-is-a-list", lambda: forge(root_claims(CP), CP, header=["EdDSA"]), ChainInvalid, "malformed", 0),
    Bad("claims-is-a-string", lambda: forge("agent-a", CP), ChainInvalid, "malformed", 0),
    Bad("non-ascii-link", lambda: ROOT.compact + "\u00e9", ChainInvalid, "malformed", 0),
    Bad("non-ascii-second-link", lambda: ROOT.compact + ",\u00e9.\u00e9.\u00e9", ChainInvalid, "malformed", 1),
    Bad("deeply-nested-json", deep_json, ChainInvalid, "malformed", 0),
    Bad("link-over-8k", broken_form({"pad": "x" * 9000}), ChainInvalid, "malformed", 0),
    Bad("crit-header", lambda: forge(root_claims(CP), CP, header={"alg": "EdDSA", "typ": GRANT_TYP,
                                                                   "crit": ["exp"]}),
        ChainInvalid, "malformed", 0),
    # header: typ and alg
    Bad("typ-jwt", lambda: forge_root(header={"alg": "EdDSA", "typ": "JWT"}).compact,
        ChainInvalid, "wrong_typ", 0),
    Bad("typ-missing", lambda: forge_root(header={"alg": "EdDSA"}).compact, ChainInvalid, "wrong_typ", 0),
    Bad("typ-proof", lambda: forge_root(header={"alg": "EdDSA", "typ": "tether-proof+jwt"}).compact,
        ChainInvalid, "wrong_typ", 0),
    Bad("alg-none-unsigned", lambda: f"{enc({'alg': 'none', 'typ': GRANT_TYP})}.{enc(root_claims(CP))}.",
        ChainInvalid, "malformed", 0),
    Bad("alg-none-with-signature", lambda: forge(root_claims(CP), None, {"alg": "none", "typ": GRANT_TYP},
                                                 signature=bytes(64)),
        ChainInvalid, "alg_not_allowed", 0),
    # The claims' shape is judged before the header's algorithm: not an object is "malformed".
    Bad("alg-none-claims-not-an-object", lambda: forge([1], None, {"alg": "none", "typ": GRANT_TYP},
                                                       signature=bytes(64)),
        ChainInvalid, "malformed", 0),
    Bad("alg-missing", lambda: forge_root(header={"typ": GRANT_TYP}).compact, ChainInvalid, "alg_not_allowed", 0),
    Bad("alg-lowercase", lambda: forge_root(header={"alg": "eddsa", "typ": GRANT_TYP}).compact,
        ChainInvalid, "alg_not_allowed", 0),
    Bad("alg-es256", lambda: forge_root(header={"alg": "ES256", "typ": GRANT_TYP}).compact,
        ChainInvalid, "alg_not_allowed", 0),
    Bad("hs256-public-key-raw-as-secret", lambda: hs256_with_public_key(keys.raw_public(CP.public_key())),
        ChainInvalid, "alg_not_allowed", 0),
    Bad("hs256-public-key-pem-as-secret", lambda: hs256_with_public_key(keys.public_pem(CP.public_key())),
        ChainInvalid, "alg_not_allowed", 0),
    # signatures
    Bad("signature-63-bytes", lambda: forge(root_claims(CP), None, signature=bytes(63)),
        ChainInvalid, "bad_signature", 0),
    Bad("signature-zeros", lambda: forge(root_claims(CP), None, signature=bytes(64)),
        ChainInvalid, "bad_signature", 0),
    Bad("signature-noncanonical-spelling", lambda: swap_last_sig_char(ROOT.compact), ChainInvalid, "malformed", 0),
    Bad("signature-stray-characters", lambda: stray_sig_chars(ROOT.compact), ChainInvalid, "malformed", 0),
    Bad("signature-standard-alphabet", std_alphabet_sig, ChainInvalid, "malformed", 0),
    Bad("signature-padded", lambda: padded_sig(ROOT.compact), ChainInvalid, "malformed", 0),
    Bad("root-signed-by-wrong-key", lambda: forge_root(signer=keys.generate()).compact,
        ChainInvalid, "bad_signature", 0),
    Bad("root-signed-by-its-subject", lambda: forge(root_claims(ROOT.key), ROOT.key),
        ChainInvalid, "bad_signature", 0),
    Bad("child-signed-by-controlplane", lambda: wire(ROOT, forge_child(ROOT, signer=CP)),
        ChainInvalid, "bad_signature", 1),
    Bad("child-signed-by-own-key", lambda: (lambda k: wire(ROOT, Node(forge(child_claims(ROOT, k), k), k)))(
        keys.generate()), ChainInvalid, "bad_signature", 1),
    Bad("grandchild-signed-by-grandparent", lambda: wire(ROOT, B, forge_child(B, signer=ROOT.key)),
        ChainInvalid, "bad_signature", 2),
    Bad("claims-edited-after-signing", lambda: wire(ROOT, (lambda n: Node(
        enc({"alg": "EdDSA", "typ": GRANT_TYP}) + "." + enc({**n.claims, "caps": {"a.read": "direct"}})
        + "." + n.compact.rsplit(".", 1)[1], n.key))(B)), ChainInvalid, "bad_signature", 1),
    # delegation rules
    Bad("widened-capability", lambda: wire(ROOT, forge_child(ROOT, caps={"a.read": "direct", "c.call": "direct"})),
        ChainInvalid, "widened_capability", 1),
    Bad("widened-capability-deep", lambda: wire(ROOT, B, forge_child(B, caps={"b.send": "direct"})),
        ChainInvalid, "widened_capability", 2),
    Bad("tier-weakened", lambda: wire(ROOT, forge_child(ROOT, caps={"a.write": "direct"})),
        ChainInvalid, "tier_weakened", 1),
    Bad("tier-weakened-deep", lambda: wire(ROOT, B, C, forge_child(C, caps={"a.read": "direct"})),
        ChainInvalid, "tier_weakened", 3),
    Bad("exp-exceeds-parent", lambda: wire(ROOT, forge_child(ROOT, exp=ROOT.link.exp + 1)),
        ChainInvalid, "exp_exceeds_parent", 1),
    Bad("exp-exceeds-grandparent-deep", lambda: wire(ROOT, B, forge_child(B, exp=B.link.exp + 60)),
        ChainInvalid, "exp_exceeds_parent", 2),
    Bad("nbf-before-parent", lambda: wire(ROOT, forge_child(ROOT, nbf=ROOT.link.nbf - 1)),
        ChainInvalid, "nbf_before_parent", 1),
    Bad("depth-equal-to-parent", lambda: wire(ROOT, forge_child(ROOT, dpth=ROOT.link.dpth)),
        ChainInvalid, "depth_not_decreasing", 1),
    Bad("depth-above-parent", lambda: wire(ROOT, forge_child(ROOT, dpth=ROOT.link.dpth + 5)),
        ChainInvalid, "depth_not_decreasing", 1),
    Bad("depth-exhausted", lambda: wire(ROOT, B, C, D, forge_child(D, dpth=0)), ChainInvalid, "depth_exhausted", 4),
    Bad("depth-exhausted-at-root", lambda: (lambda r: wire(r, forge_child(r, dpth=0)))(forge_root(dpth=0)),
        ChainInvalid, "depth_exhausted", 1),
    Bad("prf-wrong", lambda: wire(ROOT, forge_child(ROOT, prf=link_hash(B.compact))),
        ChainInvalid, "broken_prf", 1),
    Bad("prf-missing", lambda: wire(ROOT, forge_child(ROOT, prf=None)), ChainInvalid, "broken_prf", 1),
    Bad("prf-on-root", lambda: forge_root(prf=link_hash(ROOT.compact)).compact, ChainInvalid, "broken_prf", 0),
    Bad("issuer-mismatch", lambda: wire(ROOT, forge_child(ROOT, iss="agent-z")), ChainInvalid, "issuer_mismatch", 1),
    Bad("issuer-is-controlplane", lambda: wire(ROOT, forge_child(ROOT, iss=CONTROLPLANE_PRINCIPAL)),
        ChainInvalid, "issuer_mismatch", 1),
    Bad("child-catalog-differs", lambda: wire(ROOT, forge_child(ROOT, cat="sha256:" + "0" * 64)),
        ChainInvalid, "catalog_mismatch", 1),
    Bad("root-catalog-differs", lambda: Attempt(GOOD.wire, verifier={"catalog_hash": "sha256:" + "1" * 64}),
        ChainInvalid, "catalog_mismatch", 0),
    # order, repetition, size
    Bad("reordered-child-first", lambda: wire(B, ROOT), ChainInvalid, "bad_signature", 0),
    Bad("reordered-middle", lambda: wire(ROOT, C, B, D), ChainInvalid, "bad_signature", 1),
    Bad("leaf-only", lambda: D.compact, ChainInvalid, "bad_signature", 0),
    Bad("root-missing", lambda: wire(B, C, D), ChainInvalid, "bad_signature", 0),
    Bad("middle-missing", lambda: wire(ROOT, B, D), ChainInvalid, "bad_signature", 2),
    Bad("root-twice", lambda: wire(ROOT, ROOT), ChainInvalid, "bad_signature", 1),
    Bad("link-twice", lambda: wire(ROOT, B, B), ChainInvalid, "bad_signature", 2),
    Bad("self-delegation-cycle", self_delegation, ChainInvalid, "broken_prf", 2),
    Bad("jti-reused-from-ancestor", jti_reuse, ChainInvalid, "duplicate_link", 1),
    Bad("too-long-17", lambda: wire(ROOT, *[B] * MAX_LINKS), ChainInvalid, "too_long", None),
    Bad("too-long-1000", lambda: wire(*([ROOT, B, C, D] * 250)), ChainInvalid, "too_long", None),
    Bad("too-large-1mb-header", lambda: "A" * (1 << 20), ChainInvalid, "too_large", None),
    Bad("too-large-1mb-link-list", lambda: ROOT.compact + "," + "x" * (1 << 20), ChainInvalid, "too_large", None),
    # claims of the wrong shape (all properly signed by the control plane)
    Bad("claim-iss-missing", broken_form({"iss": None}), ChainInvalid, "malformed", 0),
    Bad("claim-sub-empty", broken_form({"sub": ""}), ChainInvalid, "malformed", 0),
    Bad("claim-jti-short", broken_form({"jti": "abc"}), ChainInvalid, "malformed", 0),
    Bad("claim-cat-number", broken_form({"cat": 7}), ChainInvalid, "malformed", 0),
    Bad("claim-iat-missing", broken_form({"iat": None}), ChainInvalid, "malformed", 0),
    Bad("claim-exp-string", broken_form({"exp": str(T0 + 3600)}), ChainInvalid, "malformed", 0),
    Bad("claim-exp-bool", broken_form({"exp": True}), ChainInvalid, "malformed", 0),
    Bad("claim-exp-nan", broken_form({"exp": float("nan")}), ChainInvalid, "malformed", 0),
    Bad("claim-exp-infinity", broken_form({"exp": float("inf")}), ChainInvalid, "malformed", 0),
    Bad("claim-exp-negative", broken_form({"nbf": -10, "exp": -1}), ChainInvalid, "malformed", 0),
    Bad("claim-nbf-after-exp", broken_form({"nbf": T0 + 10, "exp": T0 + 9}), ChainInvalid, "malformed", 0),
    Bad("claim-dpth-negative", broken_form({"dpth": -1}), ChainInvalid, "malformed", 0),
    Bad("claim-dpth-bool", broken_form({"dpth": True}), ChainInvalid, "malformed", 0),
    Bad("claim-dpth-float", broken_form({"dpth": 1.5}), ChainInvalid, "malformed", 0),
    Bad("claim-dpth-huge", dpth_huge, ChainInvalid, "malformed", 0),
    Bad("claim-prf-number", lambda: wire(ROOT, forge_child(ROOT, prf=1)), ChainInvalid, "malformed", 1),
    Bad("claim-caps-list", broken_form({"caps": ["a.read"]}), ChainInvalid, "malformed", 0),
    Bad("claim-caps-absent-tier", broken_form({"caps": {"a.read": "absent"}}), ChainInvalid, "malformed", 0),
    Bad("claim-caps-unknown-tier", broken_form({"caps": {"a.read": "always"}}), ChainInvalid, "malformed", 0),
    Bad("claim-cnf-missing", broken_form({"cnf": None}), ChainInvalid, "malformed", 0),
    Bad("claim-cnf-rsa", broken_form({"cnf": {"jwk": {"kty": "RSA", "n": "AQAB", "e": "AQAB"}}}),
        ChainInvalid, "malformed", 0),
    Bad("claim-cnf-short-key", broken_form({"cnf": {"jwk": {"kty": "OKP", "crv": "Ed25519", "x": "AAAA"}}}),
        ChainInvalid, "malformed", 0),
    # revocation, at every position
    *[
        Bad(f"revoked-link-{i}", lambda i=i: Attempt(GOOD.wire, revoked=frozenset({GOOD.nodes[i].link.jti})),
            ChainRevoked, "revoked", i)
        for i in range(4)
    ],
    Bad("revoked-root-of-short-chain", lambda: Attempt(wire(ROOT, B), revoked=frozenset({"f" * 32, ROOT.link.jti})),
        ChainRevoked, "revoked", 0),
    # time
    Bad("expired", lambda: Attempt(GOOD.wire, now=D.link.exp + LEEWAY_S), ChainExpired, "expired", None),
    Bad("expired-long-ago", lambda: Attempt(GOOD.wire, now=T0 + 10**6), ChainExpired, "expired", None),
    Bad("not-yet-valid", lambda: Attempt(GOOD.wire, now=T0 - LEEWAY_S - 1), ChainExpired, "not_yet_valid", None),
    Bad("expired-without-leeway", lambda: Attempt(GOOD.wire, now=D.link.exp, verifier={"leeway": 0}),
        ChainExpired, "expired", None),
    Bad("not-yet-valid-without-leeway", lambda: Attempt(GOOD.wire, now=T0 - 1, verifier={"leeway": 0}),
        ChainExpired, "not_yet_valid", None),
    Bad("revoked-and-expired-says-revoked",
        lambda: Attempt(GOOD.wire, now=T0 + 10**6, revoked=frozenset({C.link.jti})), ChainRevoked, "revoked", 2),
]


def warm_verifier(**kwargs: Any) -> Verifier:
    """A verifier whose caches already hold every good link, so a cached link cannot vouch for a bad one."""
    v = Verifier(CP.public_key(), **kwargs)
    for n in range(1, 5):
        # under a foreign catalog hash the good chains are refused, but their links are cached by then
        with contextlib.suppress(ChainInvalid):
            v.verify(wire(*GOOD.nodes[:n]), now=NOW)
    return v


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_chain_is_refused(case: Bad, warm: bool) -> None:
    attempt = case.make()
    if isinstance(attempt, str):
        attempt = Attempt(attempt)
    options = {"catalog_hash": CATALOG.hash, **attempt.verifier}
    verifier = warm_verifier(**options) if warm else Verifier(CP.public_key(), **options)
    with pytest.raises(ChainError) as info:
        verifier.verify(attempt.wire, now=attempt.now, revoked=attempt.revoked)
    err = info.value
    assert type(err) is case.exc, err
    assert err.code == case.code
    assert err.reason == case.reason, err
    assert err.link == case.link, err
    assert err.message  # says what happened
    # the same answer a second time: a failure is not cached as a success
    with pytest.raises(case.exc):
        verifier.verify(attempt.wire, now=attempt.now, revoked=attempt.revoked)


def test_table_ids_are_unique() -> None:
    assert len({c.id for c in BAD}) == len(BAD)


def test_hand_forged_links_verify_when_nothing_is_wrong() -> None:
    """The forging helpers build valid links by default, so each row above fails for its own reason."""
    root = forge_root()
    child = forge_child(root, caps={"a.read": "direct"})
    grandchild = forge_child(child, caps={"a.read": "approval"})
    verified = Verifier(CP.public_key(), catalog_hash=CATALOG.hash).verify(wire(root, child, grandchild), now=NOW)
    assert verified.caps == {"a.read": "approval"}
    assert forge_child(ROOT).link.claims.keys() == B.link.claims.keys()


@pytest.mark.parametrize("encode", [
    lambda text: b"\xef\xbb\xbf" + text.encode(),  # a UTF-8 byte-order mark
    lambda text: text.encode("utf-16"),
], ids=["utf8-bom", "utf16"])
def test_claims_are_read_as_json_loads_reads_bytes(encode: Any) -> None:
    """A signed link whose claims JSON is not plain UTF-8 gets the answer json.loads gives, not a new one."""
    claims = root_claims(keys.generate())
    signing_input = f"{enc({'alg': 'EdDSA', 'typ': GRANT_TYP})}.{keys.b64url(encode(json.dumps(claims)))}"
    compact = f"{signing_input}.{keys.b64url(CP.sign(signing_input.encode()))}"
    verified = Verifier(CP.public_key(), catalog_hash=CATALOG.hash).verify(compact, now=NOW)
    assert dict(verified.leaf.claims) == claims


def test_a_jwk_with_non_ascii_x_is_malformed() -> None:
    claims = root_claims(keys.generate())
    claims["cnf"]["jwk"]["x"] = "é" * 43
    with pytest.raises(ChainInvalid) as info:
        Verifier(CP.public_key()).verify(forge(claims, CP), now=NOW)
    assert info.value.reason == "malformed" and "only ASCII characters" in info.value.message


@pytest.mark.parametrize(
    ("now", "leeway"),
    [
        (D.link.exp + LEEWAY_S - 1, LEEWAY_S),  # inside the leeway after exp
        (T0 - LEEWAY_S, LEEWAY_S),  # inside the leeway before nbf
        (D.link.exp - 1, 0),
        (T0, 0),
    ],
)
def test_time_window_edges_are_accepted(now: float, leeway: float) -> None:
    verified = Verifier(CP.public_key(), leeway=leeway).verify(GOOD.wire, now=now)
    assert verified.exp == D.link.exp and verified.nbf == T0


# -- minting and verifying ---------------------------------------------------------------------------
def mint_chain(depth: int, now: float = T0) -> tuple[list[str], list[Ed25519PrivateKey]]:
    """A chain of ``depth`` links, each narrower than the last, with the subjects' private keys."""
    subject = keys.generate()
    compacts = [mint_root(CP, agent="agent-0", subject_key=subject.public_key(),
                          caps={"a.read": "direct", "a.write": "direct", "b.send": "approval"},
                          now=now, ttl_s=3600, depth=depth - 1, catalog=CATALOG)]
    private = [subject]
    for i in range(1, depth):
        parent = parse_link(compacts[-1])
        subject = keys.generate()
        caps = dict(parent.caps)
        if i == 2:
            caps.pop("b.send", None)
        if i == 3:
            caps["a.write"] = "approval"
        compacts.append(mint_child(parent, private[-1], agent=f"agent-{i}", subject_key=subject.public_key(),
                                   caps=caps, now=now + i, ttl_s=3600 - 100 * i, catalog=CATALOG))
        private.append(subject)
    return compacts, private


@pytest.mark.parametrize("depth", range(1, 9))
def test_mint_and_verify(depth: int) -> None:
    compacts, private = mint_chain(depth)
    verifier = Verifier(CP.public_key(), catalog_hash=CATALOG.hash)
    verified = verifier.verify(",".join(compacts), now=T0 + 20)
    assert isinstance(verified, VerifiedChain)
    assert len(verified.links) == depth
    assert verified.agent == f"agent-{depth - 1}"
    assert verified.root.iss == CONTROLPLANE_PRINCIPAL
    assert verified.leaf.dpth == 0
    assert verified.wire == ",".join(compacts)
    assert verified.jtis == tuple(parse_link(c).jti for c in compacts)
    assert all(len(jti) == 32 for jti in verified.jtis) and len(set(verified.jtis)) == depth
    assert verified.nbf == T0 + depth - 1
    assert verified.exp == T0 + 3600 - 99 * (depth - 1)  # link i: now T0 + i, ttl 3600 - 100 i
    assert verified.leaf.key_raw == keys.raw_public(private[-1].public_key())
    for i in range(1, depth):
        assert verified.links[i].prf == verified.links[i - 1].hash == link_hash(compacts[i - 1])
        assert verified.links[i].iss == verified.links[i - 1].sub
    expected_write = "approval" if depth > 3 else "direct"
    assert verified.tier("a.write") == expected_write
    assert verified.tier("b.send") == ("approval" if depth <= 2 else "absent")
    assert verified.tier("c.call") == "absent"
    # the list form is the same chain
    assert Verifier(CP.public_key()).verify(compacts, now=T0 + 20).jtis == verified.jtis
    assert [link.jti for link in parse_chain_unverified(compacts)] == list(verified.jtis)


def test_whitespace_around_links_is_tolerated() -> None:
    verified = Verifier(CP.public_key()).verify(" , ".join(n.compact for n in GOOD.nodes), now=NOW)
    assert verified.agent == "agent-d"


def test_verification_is_cached_but_revocation_and_time_are_not() -> None:
    verifier = Verifier(CP.public_key())
    first = verifier.verify(GOOD.wire, now=NOW)
    assert verifier.verify(GOOD.wire, now=NOW + 1) is first
    assert verifier.structure(GOOD.wire) is first
    with pytest.raises(ChainRevoked) as info:
        verifier.verify(GOOD.wire, now=NOW, revoked={C.link.jti})
    assert info.value.link == 2 and info.value.details["jti"] == C.link.jti
    with pytest.raises(ChainExpired):
        verifier.verify(GOOD.wire, now=T0 + 10**6)
    assert verifier.verify(GOOD.wire, now=NOW) is first


def test_cache_keeps_a_bounded_number_of_chains() -> None:
    verifier = Verifier(CP.public_key(), cache_size=2)
    chains = [wire(*GOOD.nodes[:n]) for n in (1, 2, 3)]
    first = verifier.verify(chains[0], now=NOW)
    verifier.verify(chains[1], now=NOW)
    verifier.verify(chains[2], now=NOW)
    again = verifier.verify(chains[0], now=NOW)
    assert again is not first and again.jtis == first.jtis


def test_cached_link_is_not_trusted_under_another_key() -> None:
    """A link verified as a root is cached; at another position it must be checked against that parent."""
    verifier = Verifier(CP.public_key())
    verifier.verify(ROOT.compact, now=NOW)
    with pytest.raises(ChainInvalid) as info:
        verifier.verify(wire(ROOT, ROOT), now=NOW)
    assert info.value.reason == "bad_signature"


def test_other_trust_key_refuses_everything() -> None:
    with pytest.raises(ChainInvalid) as info:
        Verifier(keys.generate().public_key()).verify(GOOD.wire, now=NOW)
    assert (info.value.reason, info.value.link) == ("bad_signature", 0)


def test_mint_root_drops_absent_and_requires_known_capabilities() -> None:
    subject = keys.generate().public_key()
    link = parse_link(mint_root(CP, agent="x", subject_key=subject, caps={"a.read": "direct", "a.write": "absent"},
                                now=T0, ttl_s=60, depth=0, catalog=CATALOG))
    assert dict(link.caps) == {"a.read": "direct"}
    assert link.prf is None and link.cat == CATALOG.hash and link.exp == T0 + 60
    with pytest.raises(UnknownCapability):
        mint_root(CP, agent="x", subject_key=subject, caps={"z.nope": "direct"}, now=T0, ttl_s=60, depth=0,
                  catalog=CATALOG)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"depth": -1}, "malformed"),
        ({"ttl_s": 0}, "malformed"),
        ({"agent": ""}, "bad_agent_id"),
        ({"agent": "a,b"}, "bad_agent_id"),
        ({"agent": "a b"}, "bad_agent_id"),
        ({"agent": "x" * 129}, "bad_agent_id"),
        ({"agent": "a/b"}, "bad_agent_id"),
        ({"agent": "caf\u00e9"}, "bad_agent_id"),
        ({"caps": {"a.read": "sometimes"}}, "malformed"),
    ],
)
def test_mint_root_refuses(kwargs: dict[str, Any], reason: str) -> None:
    args: dict[str, Any] = {"agent": "x", "subject_key": keys.generate().public_key(), "caps": {"a.read": "direct"},
                            "now": T0, "ttl_s": 60, "depth": 1, "catalog": CATALOG, **kwargs}
    with pytest.raises(ChainInvalid) as info:
        mint_root(CP, **args)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("parent", "kwargs", "exc", "reason"),
    [
        ("root", {"key": "wrong"}, ChainInvalid, "wrong_key"),
        ("root", {"key": "controlplane"}, ChainInvalid, "wrong_key"),
        ("root", {"caps": {"c.call": "direct"}}, ChainInvalid, "widened_capability"),
        ("root", {"caps": {"a.write": "direct"}}, ChainInvalid, "tier_weakened"),
        ("root", {"depth": 3}, ChainInvalid, "depth_not_decreasing"),
        ("root", {"depth": -1}, ChainInvalid, "depth_not_decreasing"),
        ("leaf", {"caps": {"a.read": "approval"}}, ChainInvalid, "depth_exhausted"),
        ("root", {"ttl_s": 0}, ChainInvalid, "malformed"),
        ("root", {"agent": "has space"}, ChainInvalid, "bad_agent_id"),
        ("root", {"now": T0 + 3600}, ChainExpired, "expired"),
    ],
)
def test_mint_child_refuses(parent: str, kwargs: dict[str, Any], exc: type[Exception], reason: str) -> None:
    node = ROOT if parent == "root" else D
    key = {"wrong": keys.generate(), "controlplane": CP}.get(kwargs.pop("key", ""), node.key)
    args: dict[str, Any] = {"agent": "y", "subject_key": keys.generate().public_key(), "caps": {"a.read": "direct"},
                            "now": T0, "ttl_s": 60, **kwargs}
    with pytest.raises(exc) as info:
        mint_child(node.link, key, **args)
    assert type(info.value) is exc and info.value.reason == reason


def test_mint_child_refuses_unknown_capability_when_given_the_catalog() -> None:
    with pytest.raises(UnknownCapability):
        mint_child(ROOT.link, ROOT.key, agent="y", subject_key=keys.generate().public_key(),
                   caps={"z.nope": "direct"}, now=T0, ttl_s=60, catalog=CATALOG)


def test_mint_child_clamps_to_the_parent_window() -> None:
    child = parse_link(mint_child(ROOT.link, ROOT.key, agent="y", subject_key=keys.generate().public_key(),
                                  caps={"a.write": "approval"}, now=T0 - 500, ttl_s=10**6))
    assert (child.nbf, child.exp) == (ROOT.link.nbf, ROOT.link.exp)
    assert child.dpth == ROOT.link.dpth - 1 and child.iat == T0 - 500


# -- request proofs ----------------------------------------------------------------------------------
def test_proof_round_trip() -> None:
    key = keys.generate()
    compact = make_proof(key, agent="agent-a", method="post", path="/v1/grants/abc/revoke", body=b'{"x":1}',
                         now=T0 + 0.5, link=ROOT.link.hash)
    proof = read_proof(compact)
    assert (proof.agent, proof.link, proof.claims["htm"]) == ("agent-a", ROOT.link.hash, "POST")
    check_proof(proof, key.public_key(), method="POST", path="/v1/grants/abc/revoke", body=b'{"x":1}', now=T0 + 30)
    check_proof(proof, key.public_key(), method="post", path="/v1/grants/abc/revoke", body=b'{"x":1}', now=T0 - 4)
    other = read_proof(make_proof(key, agent="agent-a", method="GET", path="/", body=b"", now=T0))
    assert other.jti != proof.jti and other.link is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"key": "other"}, "signature does not verify"),
        ({"method": "DELETE"}, "another request"),
        ({"path": "/v1/grants/abd/revoke"}, "another request"),
        ({"path": "/v1/grants/abc/revoke?x=1"}, "another request"),
        ({"body": b'{"x":2}'}, "body"),
        ({"body": b""}, "body"),
        ({"now": T0 + 61}, "older than 60s"),
        ({"now": T0 - 6}, "in the future"),  # dated ahead: only the clock leeway (5 s), never the age bound
        ({"now": T0 - 59}, "in the future"),
        ({"now": T0 + 11, "max_age": 10}, "older than 10s"),
    ],
)
def test_proof_refused(change: dict[str, Any], message: str) -> None:
    change = dict(change)
    key = keys.generate()
    proof = read_proof(make_proof(key, agent="a", method="POST", path="/v1/grants/abc/revoke", body=b'{"x":1}',
                                  now=T0))
    args: dict[str, Any] = {"method": "POST", "path": "/v1/grants/abc/revoke", "body": b'{"x":1}', "now": T0}
    check_key = keys.generate().public_key() if change.pop("key", None) else key.public_key()
    args.update(change)
    check_proof(proof, key.public_key(), method="POST", path="/v1/grants/abc/revoke", body=b'{"x":1}', now=T0)
    with pytest.raises(ApiError) as info:
        check_proof(proof, check_key, **args)
    assert info.value.code == UNAUTHORIZED and info.value.http_status == 401
    assert message in info.value.message


@pytest.mark.parametrize("iat", ["NaN", "Infinity", "1e999", str(10**400), "true", '"1"', "null"])
def test_proof_with_a_non_finite_iat_is_refused_when_read(iat: str) -> None:
    """NaN would be forever fresh, 10**400 overflows a float: both are a 401, never a 500."""
    key = keys.generate()
    compact = make_proof(key, agent="a", method="GET", path="/", body=b"", now=T0)
    h, p, _s = compact.split(".")
    claims = json.loads(keys.b64url_decode(p))
    payload = json.dumps({**claims, "iat": 0}).replace('"iat": 0', f'"iat": {iat}').encode()
    p = keys.b64url(payload)
    signature = keys.b64url(key.sign(f"{h}.{p}".encode()))
    with pytest.raises(ApiError) as info:
        check_proof(read_proof(f"{h}.{p}.{signature}"), key.public_key(), method="GET", path="/", body=b"", now=T0)
    assert info.value.http_status == 401 and "iat" in info.value.message


def _proof_parts(**claims: Any) -> dict[str, Any]:
    return {"sub": "a", "htm": "GET", "htu": "/", "bh": "x", "iat": T0, "jti": "j", **claims}


@pytest.mark.parametrize(
    "compact",
    [
        pytest.param("a.b", id="two-parts"),
        pytest.param("a.b.c.d", id="four-parts"),
        pytest.param(f"{enc(b'nope')}.{enc(_proof_parts())}.{enc(bytes(64))}", id="header-not-json"),
        pytest.param(f"{enc({'alg': 'EdDSA', 'typ': 'tether-proof+jwt'})}.{enc(b'[' * 5000)}.{enc(bytes(64))}",
                     id="deep-json"),
        pytest.param(f"{enc({'alg': 'HS256', 'typ': 'tether-proof+jwt'})}.{enc(_proof_parts())}.{enc(bytes(32))}",
                     id="hs256"),
        pytest.param(f"{enc({'alg': 'EdDSA', 'typ': GRANT_TYP})}.{enc(_proof_parts())}.{enc(bytes(64))}",
                     id="grant-typ"),
        pytest.param(f"{enc({'alg': 'EdDSA', 'typ': 'tether-proof+jwt'})}.{enc(_proof_parts(bh=None))}."
                     f"{enc(bytes(64))}", id="bh-missing"),
        pytest.param(f"{enc({'alg': 'EdDSA', 'typ': 'tether-proof+jwt'})}.{enc(_proof_parts(iat='now'))}."
                     f"{enc(bytes(64))}", id="iat-string"),
        pytest.param(f"{enc({'alg': 'EdDSA', 'typ': 'tether-proof+jwt'})}.{enc(['a'])}.{enc(bytes(64))}",
                     id="claims-list"),
    ],
)
def test_malformed_proof_is_unauthorized(compact: str) -> None:
    with pytest.raises(ApiError) as info:
        read_proof(compact)
    assert info.value.code == UNAUTHORIZED and info.value.http_status == 401


def test_a_grant_link_is_not_a_proof() -> None:
    with pytest.raises(ApiError):
        read_proof(ROOT.compact)


def test_b64url_helpers_round_trip() -> None:
    for raw in (b"", b"\x00", b"\xff\xfe", bytes(range(64))):
        assert keys.b64url_decode(keys.b64url(raw)) == raw
        assert "=" not in keys.b64url(raw)
        assert keys.b64url(raw) == base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize("typ", [GRANT_TYP, "tether-proof+jwt"])
def test_links_and_proofs_are_signed_byte_for_byte_as_pyjwt_signs_them(typ: str) -> None:
    # The sidecar signs without PyJWT (keys.sign_jws); what it writes must be what PyJWT writes, so links minted
    # before and after read alike. Ed25519 signatures are deterministic: the whole compact form compares.
    import jwt

    key = Ed25519PrivateKey.generate()
    claims: dict[str, Any] = {"sub": "agent-1", "iat": 1_800_000_000.125, "jti": "0123456789abcdef01234567",
                              "caps": {"tickets.read": "direct", "naïve": {"tier": "approval", "calls": 3}},
                              "note": "quote \" slash / unicode \u2603"}
    assert keys.sign_jws(claims, key, typ) == jwt.encode(claims, key, algorithm="EdDSA", headers={"typ": typ})
    with pytest.raises(TypeError):
        keys.sign_jws({**claims, "iss": 7}, key, typ)
