"""Chain rules as properties: every honestly delegated chain verifies; every single-link change fails.

A change to one link either keeps its old signature (or flips a signature bit, or re-signs with a key
that is not the parent's), and then the chain is refused for a bad signature at exactly that link; or it
is re-signed with the right key, and then the docs/contract.md section 4 rules decide: a change to a link that
has a child breaks the child's ``prf`` (refused), and a change to the leaf is accepted exactly when it
still satisfies every rule against its parent (a narrowing, a fresh jti, another subject key), and is
refused with the reason of the rule it breaks otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import GRANT_TYP, Verifier, link_hash, mint_child, mint_root, parse_link
from tether.capability.errors import CHAIN_INVALID, ChainInvalid

CAPS = ["a.read", "a.write", "b.send", "c.call", "d.query"]
CATALOG = parse_catalog(
    "capabilities:\n" + "".join(f"  {c}: {{http: {{host: h.example, methods: [GET], path: /{c}}}}}\n" for c in CAPS)
)
TRUST = keys.generate()
POOL = [keys.generate() for _ in range(8)]
T0 = 1_750_000_000
VERIFY_AT = T0 + 100  # every link is minted at T0 + index and lives at least 200 s
LEEWAY = 30
TIERS = ("direct", "approval")

PROPERTY = settings(max_examples=100, deadline=None)


@dataclass
class Chain:
    compacts: list[str]
    subjects: list[Ed25519PrivateKey]  # subjects[i] signs link i + 1

    def signer(self, index: int) -> Ed25519PrivateKey:
        return TRUST if index == 0 else self.subjects[index - 1]


def verifier() -> Verifier:
    return Verifier(TRUST.public_key(), catalog_hash=CATALOG.hash, leeway=LEEWAY)


@st.composite
def chains(draw: st.DrawFn) -> Chain:
    depth = draw(st.integers(1, 6))
    jtis = draw(st.lists(st.binary(min_size=16, max_size=16), min_size=depth, max_size=depth, unique=True))
    subjects = [POOL[draw(st.integers(0, len(POOL) - 1))] for _ in range(depth)]
    caps = draw(st.dictionaries(st.sampled_from(CAPS), st.sampled_from(TIERS), min_size=2))
    compacts = [mint_root(TRUST, agent="agent-0", subject_key=subjects[0].public_key(), caps=caps, now=T0,
                          ttl_s=draw(st.integers(200, 100_000)), depth=depth - 1 + draw(st.integers(0, 2)),
                          catalog=CATALOG, jti=jtis[0].hex())]
    for i in range(1, depth):
        parent = parse_link(compacts[-1])
        # keep most capabilities (each with odds 3:1) so that deep chains still hold some to mutate
        kept = [name for name in sorted(parent.caps) if draw(st.integers(0, 3))]
        caps = {name: draw(st.sampled_from(TIERS)) if parent.caps[name] == "direct" else "approval" for name in kept}
        child_depth = draw(st.integers(depth - 1 - i, parent.dpth - 1))
        compacts.append(mint_child(parent, subjects[i - 1], agent=f"agent-{i}", subject_key=subjects[i].public_key(),
                                   caps=caps, now=T0 + i, ttl_s=draw(st.integers(200, 100_000)), depth=child_depth,
                                   catalog=CATALOG, jti=jtis[i].hex()))
    return Chain(compacts, subjects)


@given(chains())
@PROPERTY
def test_every_honest_chain_verifies(chain: Chain) -> None:
    verified = verifier().verify(",".join(chain.compacts), now=VERIFY_AT)
    leaf = parse_link(chain.compacts[-1])
    assert verified.caps == leaf.caps
    assert verified.agent == f"agent-{len(chain.compacts) - 1}"
    assert verified.jtis == tuple(parse_link(c).jti for c in chain.compacts)
    # caps only ever narrow along the chain
    for parent, child in zip(verified.links, verified.links[1:], strict=False):
        assert set(child.caps) <= set(parent.caps)
        assert all(parent.caps[c] == "direct" or t == "approval" for c, t in child.caps.items())
        assert child.exp <= parent.exp and child.nbf >= parent.nbf and child.dpth < parent.dpth


# -- mutations ---------------------------------------------------------------------------------------
def sign(claims: dict[str, Any], key: Ed25519PrivateKey) -> str:
    """The same serialization PyJWT uses, so re-signing unchanged claims reproduces the link exactly."""
    header = keys.b64url(json.dumps({"alg": "EdDSA", "typ": GRANT_TYP}, separators=(",", ":")).encode())
    payload = keys.b64url(json.dumps(claims, separators=(",", ":")).encode())
    signature = key.sign(f"{header}.{payload}".encode())
    return f"{header}.{payload}.{keys.b64url(signature)}"


CLAIM_MUTATIONS = [
    "caps_add", "tier_widen", "caps_drop", "tier_narrow", "exp_later", "exp_earlier", "nbf_earlier",
    "nbf_later", "dpth_up", "dpth_down", "iss", "sub", "prf", "cat", "jti_new", "jti_ancestor", "cnf",
]


def applicable(kind: str, claims: dict[str, Any], index: int) -> bool:
    tiers = set(claims["caps"].values())
    return {
        "tier_widen": "approval" in tiers,
        "caps_drop": bool(claims["caps"]),
        "tier_narrow": "direct" in tiers,
        "dpth_down": claims["dpth"] > 0,
        "jti_ancestor": index > 0,
    }.get(kind, True)


def mutate(draw: st.DrawFn, kind: str, claims: dict[str, Any], chain: Chain, index: int) -> dict[str, Any]:
    c = json.loads(json.dumps(claims))
    caps: dict[str, str] = c["caps"]
    if kind == "caps_add":
        caps["z.not.granted"] = draw(st.sampled_from(TIERS))
    elif kind == "tier_widen":
        caps[draw(st.sampled_from(sorted(k for k, v in caps.items() if v == "approval")))] = "direct"
    elif kind == "caps_drop":
        del caps[draw(st.sampled_from(sorted(caps)))]
    elif kind == "tier_narrow":
        caps[draw(st.sampled_from(sorted(k for k, v in caps.items() if v == "direct")))] = "approval"
    elif kind == "exp_later":
        c["exp"] += draw(st.integers(1, 1000))
    elif kind == "exp_earlier":
        c["exp"] = draw(st.integers(VERIFY_AT - LEEWAY + 1, c["exp"] - 1))
    elif kind == "nbf_earlier":
        c["nbf"] -= draw(st.integers(1, 1000))
    elif kind == "nbf_later":
        c["nbf"] = draw(st.integers(c["nbf"] + 1, VERIFY_AT + LEEWAY))
    elif kind == "dpth_up":
        c["dpth"] += draw(st.integers(1, 3))
    elif kind == "dpth_down":
        c["dpth"] = draw(st.integers(0, c["dpth"] - 1))
    elif kind == "iss":
        c["iss"] = "mallory"
    elif kind == "sub":
        c["sub"] = "someone-else"
    elif kind == "prf":
        c["prf"] = link_hash("not the parent")
    elif kind == "cat":
        c["cat"] = "sha256:" + "0" * 64
    elif kind == "jti_new":
        c["jti"] = draw(st.binary(min_size=16, max_size=16)).hex() + "ff"  # never one of the chain's own
    elif kind == "jti_ancestor":
        c["jti"] = parse_link(chain.compacts[draw(st.integers(0, index - 1))]).jti
    elif kind == "cnf":
        current = keys.to_jwk(parse_link(chain.compacts[index]).key)
        others = [k for k in POOL if keys.to_jwk(k.public_key()) != current]
        c["cnf"] = {"jwk": keys.to_jwk(draw(st.sampled_from(others)).public_key())}
    else:  # pragma: no cover
        raise AssertionError(kind)
    assert c != claims, kind
    return c


def leaf_verdict(kind: str, old: dict[str, Any], new: dict[str, Any], parent: dict[str, Any] | None) -> str | None:
    """The rule a re-signed leaf breaks, or None when the rules accept it. The oracle: docs/contract.md section 4."""
    if kind == "prf":
        return "broken_prf"
    if kind == "cat":
        return "catalog_mismatch"
    if parent is None:  # the root answers to no one but the control plane, which signed it
        return None
    if kind == "iss":
        return "issuer_mismatch"
    if kind == "caps_add":
        return "widened_capability"
    if kind == "tier_widen":
        widened = next(k for k in new["caps"] if new["caps"][k] != old["caps"][k])
        return "tier_weakened" if parent["caps"][widened] == "approval" else None
    if kind == "exp_later":
        return "exp_exceeds_parent" if new["exp"] > parent["exp"] else None
    if kind == "nbf_earlier":
        return "nbf_before_parent" if new["nbf"] < parent["nbf"] else None
    if kind == "dpth_up":
        return "depth_not_decreasing" if new["dpth"] >= parent["dpth"] else None
    if kind == "jti_ancestor":
        return "duplicate_link"
    return None  # caps_drop, tier_narrow, exp_earlier, nbf_later, dpth_down, sub, jti_new, cnf


def flip_bit(compact: str, draw: st.DrawFn) -> str:
    head, sig = compact.rsplit(".", 1)
    raw = bytearray(keys.b64url_decode(sig))
    raw[draw(st.integers(0, 63))] ^= 1 << draw(st.integers(0, 7))
    return f"{head}.{keys.b64url(bytes(raw))}"


def mutated_chain(chain: Chain, index: int, compact: str) -> str:
    return ",".join([*chain.compacts[:index], compact, *chain.compacts[index + 1:]])


def refusal(chain: Chain, wire: str) -> ChainInvalid | None:
    try:
        verifier().verify(wire, now=VERIFY_AT)
    except ChainInvalid as err:
        assert type(err) is ChainInvalid and err.code == CHAIN_INVALID
        return err
    return None


@given(chains(), st.data())
@PROPERTY
def test_a_link_whose_signature_does_not_match_is_refused_there(chain: Chain, data: st.DataObject) -> None:
    """Claims changed under the old signature, a flipped signature bit, or a key that is not the parent's."""
    draw = data.draw
    index = draw(st.integers(0, len(chain.compacts) - 1), label="index")
    old = dict(parse_link(chain.compacts[index]).claims)
    signer = draw(st.sampled_from(["stale", "flip", "wrong"]), label="signer")
    kinds = [k for k in CLAIM_MUTATIONS if applicable(k, old, index)] + ([] if signer == "stale" else ["none"])
    kind = draw(st.sampled_from(kinds), label="kind")
    new = old if kind == "none" else mutate(draw, kind, old, chain, index)
    right = chain.signer(index)
    if signer == "stale":
        compact = sign(new, right).rsplit(".", 1)[0] + "." + chain.compacts[index].rsplit(".", 1)[1]
    elif signer == "flip":
        compact = flip_bit(sign(new, right), draw)
    else:
        right_raw = keys.raw_public(right.public_key())
        wrong = draw(st.sampled_from([k for k in [*POOL, TRUST] if keys.raw_public(k.public_key()) != right_raw]))
        compact = sign(new, wrong)
    err = refusal(chain, mutated_chain(chain, index, compact))
    assert err is not None, f"{kind} at link {index} with signer {signer} was accepted"
    assert (err.reason, err.link) == ("bad_signature", index), f"{kind}/{signer} at link {index}: {err}"


@given(chains().filter(lambda c: len(c.compacts) > 1), st.data())
@PROPERTY
def test_a_re_signed_inner_link_breaks_its_child(chain: Chain, data: st.DataObject) -> None:
    draw = data.draw
    index = draw(st.integers(0, len(chain.compacts) - 2), label="index")
    old = dict(parse_link(chain.compacts[index]).claims)
    kind = draw(st.sampled_from([k for k in CLAIM_MUTATIONS if applicable(k, old, index)]), label="kind")
    new = mutate(draw, kind, old, chain, index)
    err = refusal(chain, mutated_chain(chain, index, sign(new, chain.signer(index))))
    assert err is not None, f"{kind} at inner link {index} was accepted"
    assert err.link in (index, index + 1), f"{kind} at link {index}: refused at {err.link}: {err}"


@given(chains(), st.data())
@settings(max_examples=200, deadline=None)
def test_a_re_signed_leaf_is_judged_by_the_rules(chain: Chain, data: st.DataObject) -> None:
    """Accepted exactly when the rules allow it (a narrowing, a fresh jti, another key), else refused by the rule."""
    draw = data.draw
    index = len(chain.compacts) - 1
    old = dict(parse_link(chain.compacts[index]).claims)
    kind = draw(st.sampled_from([k for k in CLAIM_MUTATIONS if applicable(k, old, index)]), label="kind")
    new = mutate(draw, kind, old, chain, index)
    parent = dict(parse_link(chain.compacts[index - 1]).claims) if index else None
    verdict = leaf_verdict(kind, old, new, parent)
    wire = mutated_chain(chain, index, sign(new, chain.signer(index)))
    err = refusal(chain, wire)
    if verdict is None:
        assert err is None, f"{kind} of the leaf (link {index}) was refused: {err}"
        assert dict(verifier().verify(wire, now=VERIFY_AT).leaf.claims) == new
    else:
        assert err is not None, f"{kind} of the leaf (link {index}) was accepted; expected {verdict}"
        assert (err.reason, err.link) == (verdict, index), f"{kind} of link {index}: {err}"


@given(chains(), st.data())
@PROPERTY
def test_narrowed_leaf_re_signed_by_parent_verifies(chain: Chain, data: st.DataObject) -> None:
    """The other half, stated directly: mint_child's own narrowing of the leaf always verifies."""
    draw = data.draw
    subject = POOL[draw(st.integers(0, len(POOL) - 1))]
    leaf = parse_link(chain.compacts[-1])
    if leaf.dpth == 0:
        chain = Chain(chain.compacts[:-1], chain.subjects[:-1]) if len(chain.compacts) > 1 else chain
        leaf = parse_link(chain.compacts[-1])
    if leaf.dpth == 0:
        return  # a root without delegation depth: nothing can be delegated (tested in test_chain.py)
    kept = draw(st.lists(st.sampled_from(sorted(leaf.caps)), unique=True)) if leaf.caps else []
    caps = {k: "approval" if leaf.caps[k] == "approval" else draw(st.sampled_from(TIERS)) for k in kept}
    index = len(chain.compacts)
    compact = mint_child(leaf, chain.subjects[-1], agent=f"agent-{index}", subject_key=subject.public_key(),
                         caps=caps, now=T0 + index, ttl_s=draw(st.integers(200, 10**6)))
    verified = verifier().verify([*chain.compacts, compact], now=VERIFY_AT)
    assert verified.caps == caps and len(verified.links) == index + 1
