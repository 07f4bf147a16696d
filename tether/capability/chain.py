"""Grant links and capability chains (docs/contract.md section 4).

A link is a compact JWS (``typ: tether-grant+jwt``, ``alg: EdDSA`` only). A chain is its links, root
first. Minting refuses to produce a link that could not verify; verification checks every rule and
raises a ChainError whose ``reason`` names the rule. Time is always passed in.

Verification is cached at two levels: a link whose signature was checked under a given key is not
checked again (keyed by the link's hash), and a whole chain whose structure verified is kept by its
wire form, so a warm call pays only for the time window and the revocation lookups.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
import re
from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import keys
from .budget import Grant, GrantError, normalize, split_caps, widening
from .catalog import Catalog
from .errors import ChainExpired, ChainInvalid, ChainRevoked, KeyError_

GRANT_TYP = "tether-grant+jwt"
ALG = "EdDSA"
MAX_LINKS = 16
MAX_LINK_BYTES = 8 * 1024
MAX_CHAIN_BYTES = 64 * 1024
LEEWAY_S = 5  # clock skew tolerated between issuer, control plane and sidecar
CONTROLPLANE_PRINCIPAL = "tether:controlplane"
# docs/contract.md section 10: an agent id is 1-128 of letters, digits, ".", "_", ":", "-" (ASCII). Checked at
# minting and wherever a link is parsed, for ``sub`` and ``iss`` (which names the parent's agent, or the
# control plane as "tether:controlplane"): ids land in URL paths, logs, terminals and record files.
AGENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def shown(value: Any, limit: int = 80) -> str:
    """Untrusted text as it may appear in a message: quoted, every control character, lone surrogate and
    non-ASCII character escaped (no terminal escape, no line forging, nothing an encoder refuses)."""
    text = value if isinstance(value, str) else repr(value)
    return ascii(text[:limit]) + ("..." if len(text) > limit else "")


def link_hash(compact: str) -> str:
    """SHA-256 of the link's wire form, base64url: the value a child's ``prf`` names."""
    return keys.b64url(hashlib.sha256(compact.encode("ascii")).digest())


def new_jti() -> str:
    return os.urandom(16).hex()


class Link(NamedTuple):
    """One decoded link. Built by ``parse_link``, which has checked every field's form (not the signature)."""

    compact: str
    hash: str
    claims: Mapping[str, Any]
    signing_input: bytes
    signature: bytes
    key_raw: bytes  # cnf.jwk's 32 bytes: the subject's key, which signs the next link
    iss: str
    sub: str
    jti: str
    iat: float
    nbf: float
    exp: float
    prf: str | None
    caps: Mapping[str, str]  # capability -> tier (the claim's objects reduced to their tier)
    dpth: int
    cat: str
    budgets: Mapping[str, Grant] = {}  # the budgeted capabilities' full grants (docs/contract.md section 10)

    def grant(self, capability: str) -> Grant | None:
        tier = self.caps.get(capability)
        if tier is None:
            return None
        return self.budgets.get(capability) or Grant(tier)

    @property
    def key(self) -> Ed25519PublicKey:
        # Built on demand: a leaf's key is never needed to verify its own chain.
        return Ed25519PublicKey.from_public_bytes(self.key_raw)


class VerifiedChain(NamedTuple):
    """A chain whose structure and signatures verified. Time and revocation are checked per use."""

    links: tuple[Link, ...]
    nbf: float
    exp: float
    issued: float = 0.0  # the latest iat in the chain

    @property
    def leaf(self) -> Link:
        return self.links[-1]

    @property
    def root(self) -> Link:
        return self.links[0]

    @property
    def agent(self) -> str:
        return self.leaf.sub

    @property
    def caps(self) -> Mapping[str, str]:
        return self.leaf.caps

    @property
    def jtis(self) -> tuple[str, ...]:
        return tuple(link.jti for link in self.links)

    @property
    def wire(self) -> str:
        return ",".join(link.compact for link in self.links)

    def check(self, now: float, revoked: Container[str] = (), leeway: float = LEEWAY_S) -> None:
        """Raise ChainRevoked or ChainExpired if the chain may not be used at ``now``."""
        for index, link in enumerate(self.links):
            if link.jti in revoked:
                raise ChainRevoked(
                    f"link {index} (jti {link.jti}, issued to {link.sub}) has been revoked; "
                    "ask the issuer for a new grant",
                    link=index,
                    jti=link.jti,
                )
        if now + leeway < self.nbf:
            raise ChainExpired("not_yet_valid", f"the chain is not valid before {self.nbf:.0f}")
        if now + leeway < self.issued:  # after nbf: a chain not valid yet says so first
            # A link dated in the future comes from a clock that is wrong or a signer that lies about time.
            raise ChainExpired("issued_in_future", f"a link of the chain is issued at {self.issued:.0f}, after now "
                               f"({now:.0f}) beyond the {leeway:g}s clock leeway; check the issuer's clock")
        if now - leeway >= self.exp:
            raise ChainExpired("expired", f"the chain expired at {self.exp:.0f}; ask for a fresh grant")

    def tier(self, capability: str) -> str:
        return self.caps.get(capability, "absent")


# -- minting ---------------------------------------------------------------------------------------
def _normalize_caps(caps: Mapping[str, Any], catalog: Catalog | None) -> dict[str, Any]:
    """Caps as given (tiers, ``{tier, calls, per_minute}`` objects or Grants) in their claim form."""
    try:
        out = normalize(caps)
    except GrantError as exc:
        raise ChainInvalid("malformed", str(exc)) from None
    if catalog is not None:
        catalog.require(out)
    return out


def _sign(claims: dict[str, Any], key: Ed25519PrivateKey) -> str:
    return keys.sign_jws(claims, key, GRANT_TYP)


def mint_root(
    signing_key: Ed25519PrivateKey,
    *,
    agent: str,
    subject_key: Ed25519PublicKey,
    caps: Mapping[str, Any],
    now: float,
    ttl_s: float,
    depth: int,
    catalog: Catalog,
    issuer: str = CONTROLPLANE_PRINCIPAL,
    jti: str | None = None,
) -> str:
    if depth < 0:
        raise ChainInvalid("malformed", "depth must be 0 or more")
    if ttl_s <= 0:
        raise ChainInvalid("malformed", "ttl must be positive")
    _check_principal(agent)
    claims = {
        "iss": issuer,
        "sub": agent,
        "jti": jti or new_jti(),
        "iat": int(now),
        "nbf": int(now),
        "exp": int(now + ttl_s),
        "cnf": {"jwk": keys.to_jwk(subject_key)},
        "caps": _normalize_caps(caps, catalog),
        "dpth": int(depth),
        "cat": catalog.hash,
    }
    return _sign(claims, signing_key)


def mint_child(
    parent: Link,
    parent_key: Ed25519PrivateKey,
    *,
    agent: str,
    subject_key: Ed25519PublicKey,
    caps: Mapping[str, Any],
    now: float,
    ttl_s: float,
    depth: int | None = None,
    catalog: Catalog | None = None,
    jti: str | None = None,
) -> str:
    """Delegate a narrower link under ``parent``. Refuses (ChainInvalid) anything that would not verify."""
    if keys.raw_public(parent_key.public_key()) != parent.key_raw:
        raise ChainInvalid(
            "wrong_key", f"the key given does not belong to {parent.sub}, the subject of the parent link"
        )
    _check_principal(agent)
    child_caps = _normalize_caps(caps, catalog)
    _check_narrowing(parent, *split_caps(child_caps), index=None)
    if parent.dpth <= 0:
        raise ChainInvalid("depth_exhausted", f"{parent.sub}'s grant does not allow further delegation")
    child_depth = parent.dpth - 1 if depth is None else depth
    if not 0 <= child_depth < parent.dpth:
        raise ChainInvalid("depth_not_decreasing", f"depth must be below the parent's ({parent.dpth})")
    if ttl_s <= 0:
        raise ChainInvalid("malformed", "ttl must be positive")
    nbf = max(int(now), int(parent.nbf))
    exp = min(int(now + ttl_s), int(parent.exp))
    if exp <= nbf:
        raise ChainExpired("expired", f"the parent grant of {parent.sub} has expired; nothing to delegate")
    claims = {
        "iss": parent.sub,
        "sub": agent,
        "jti": jti or new_jti(),
        "iat": int(now),
        "nbf": nbf,
        "exp": exp,
        "prf": parent.hash,
        "cnf": {"jwk": keys.to_jwk(subject_key)},
        "caps": child_caps,
        "dpth": child_depth,
        "cat": parent.cat,
    }
    return _sign(claims, parent_key)


def _check_principal(agent: str) -> None:
    if not isinstance(agent, str) or not AGENT_ID.fullmatch(agent):
        raise ChainInvalid("bad_agent_id", f"agent id {shown(agent)} must be 1-128 characters of letters, digits, "
                           "'.', '_', ':' and '-'")


def _check_narrowing(parent: Link, caps: Mapping[str, str], budgets: Mapping[str, Grant], index: int | None) -> None:
    for name, tier in caps.items():
        parent_tier = parent.caps.get(name)
        if parent_tier is None:
            raise ChainInvalid(
                "widened_capability",
                f"{name} is not granted to {parent.sub}, so it cannot be delegated",
                link=index,
                capability=name,
            )
        if parent_tier == "approval" and tier == "direct":
            raise ChainInvalid(
                "tier_weakened",
                f"{name} is 'approval' for {parent.sub}; a delegate cannot hold it 'direct'",
                link=index,
                capability=name,
            )
        if parent.budgets or budgets:  # budgets: only ever narrowed, never removed
            wide = widening(parent.grant(name), budgets.get(name) or Grant(tier))
            if wide is not None:
                raise ChainInvalid(wide[0], f"{name} for {parent.sub}'s delegate: {wide[1]}", link=index,
                                   capability=name)


# -- parsing ---------------------------------------------------------------------------------------
def _malformed(index: int, what: str) -> ChainInvalid:
    return ChainInvalid("malformed", f"link {index}: {what}", link=index)


def _is_time(value: Any) -> bool:
    return (type(value) is int or type(value) is float) and 0 <= value < 2**41


# The header every tether link carries (PyJWT's serialization); decoding it is skipped on the hot path.
_GRANT_HEADER = {"alg": ALG, "typ": GRANT_TYP}
_GRANT_HEADER_B64 = keys.b64url(json.dumps(_GRANT_HEADER, separators=(",", ":")).encode())
_CLAIM_STRINGS = ("iss", "sub", "jti", "cat")
_AGENT_ID_MATCH = AGENT_ID.fullmatch
_JTI_MATCH = re.compile(r"[A-Za-z0-9._:-]{16,128}").fullmatch
_json = json.JSONDecoder().decode


def _json_bytes(raw: bytes) -> Any:
    """``json.loads(raw)``: plain UTF-8 without its type dispatch and encoding sniffing; anything else
    (a byte-order mark, UTF-16/32, surrogates) the way json.loads reads it."""
    try:
        return _json(raw.decode())
    except ValueError:
        return json.loads(raw)


_CLAIM_TIMES = ("iat", "nbf", "exp")


def parse_link(compact: str, index: int = 0, digest: str | None = None) -> Link:
    """Decode one link and check its form (not its signature). Raises ChainInvalid.

    ``digest`` is the link's hash when the caller has already computed it.
    """
    if not isinstance(compact, str) or not compact or len(compact) > MAX_LINK_BYTES:
        raise _malformed(index, f"a link is a compact JWS of at most {MAX_LINK_BYTES} bytes")
    parts = compact.split(".")
    if len(parts) != 3 or not all(parts):
        raise _malformed(index, "a link is a compact JWS: three base64url parts joined by '.'")
    head, body, sig = parts
    try:
        header = _GRANT_HEADER if head == _GRANT_HEADER_B64 else _json_bytes(keys.b64url_decode(head))
        claims = _json_bytes(keys.b64url_decode(body))
        signature = keys.b64url_decode(sig)
    except (ValueError, binascii.Error, UnicodeError, RecursionError):
        raise _malformed(index, "not base64url-encoded JSON") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise _malformed(index, "header and claims must be JSON objects")
    if header is not _GRANT_HEADER:
        _check_header(header, index)
    if len(signature) != 64:
        raise ChainInvalid("bad_signature", f"link {index}: an Ed25519 signature is 64 bytes", link=index)
    if len(sig) != 86 or sig[-1] not in "AQgw" or "+" in sig or "/" in sig:
        # The lenient decoder skips stray characters, ignores trailing bits and takes '+/' for '-_', so one
        # signature has many spellings; each would give the same link another hash. Accept only the
        # canonical one: 64 bytes decoded from exactly 86 characters means none was skipped, and the last
        # one must leave its 4 unused bits zero.
        raise _malformed(index, "the signature is not canonical unpadded base64url")
    # One pass over the well-formed case; anything off is explained (and refused) by _claims_error.
    try:
        iss, sub, jti, cat = claims["iss"], claims["sub"], claims["jti"], claims["cat"]
        iat, nbf, exp, dpth, caps = claims["iat"], claims["nbf"], claims["exp"], claims["dpth"], claims["caps"]
        prf = claims.get("prf")
        jwk = claims["cnf"]["jwk"]
        key_raw = keys.b64url_decode(jwk["x"]) if jwk["kty"] == "OKP" and jwk["crv"] == "Ed25519" else b""
        well_formed = (
            type(iss) is str and type(sub) is str and type(cat) is str and cat
            and _AGENT_ID_MATCH(sub) is not None
            and (iss == CONTROLPLANE_PRINCIPAL or _AGENT_ID_MATCH(iss) is not None)
            and type(jti) is str and 16 <= len(jti) <= 128
            and ((jti.isascii() and jti.isalnum()) or _JTI_MATCH(jti) is not None)  # minted: hex, no regex
            and _is_time(iat) and _is_time(nbf) and _is_time(exp) and nbf <= exp
            and type(dpth) is int and dpth >= 0
            and ((prf is None and "prf" not in claims) or type(prf) is str)
            and len(key_raw) == 32 and "d" not in jwk
        )
        tiers, budgets = split_caps(caps)  # GrantError is a ValueError: a malformed link
    except (KeyError, TypeError, ValueError, binascii.Error):
        well_formed = False
    if not well_formed:
        raise _claims_error(claims, index)
    return Link(compact, digest or link_hash(compact), claims, f"{head}.{body}".encode("ascii"), signature,
                key_raw, iss, sub, jti, iat, nbf, exp, prf, tiers, dpth, cat, budgets)


def _check_header(header: dict[str, Any], index: int) -> None:
    if header.get("alg") != ALG:
        raise ChainInvalid(
            "alg_not_allowed", f"link {index}: alg {header.get('alg')!r} is refused; only EdDSA", link=index
        )
    if header.get("typ") != GRANT_TYP:
        raise ChainInvalid("wrong_typ", f"link {index}: typ must be {GRANT_TYP!r}", link=index)
    if "crit" in header:
        raise _malformed(index, "critical header extensions are not supported")


def _claims_error(claims: dict[str, Any], index: int) -> ChainInvalid:
    """The first rule a link's claims break, as the error to raise (the slow path of parse_link)."""
    for name in _CLAIM_STRINGS:
        if not isinstance(claims.get(name), str) or not claims[name]:
            return _malformed(index, f"claim {name!r} must be a non-empty string")
    for name in ("sub", "iss"):
        if not AGENT_ID.fullmatch(claims[name]):
            return ChainInvalid("bad_agent_id", f"link {index}: claim {name!r} is {shown(claims[name])}, not an agent "
                                "id (1-128 characters of letters, digits, '.', '_', ':' and '-')", link=index)
    if not 16 <= len(claims["jti"]) <= 128:
        return _malformed(index, "claim 'jti' must carry at least 128 bits")
    if not _JTI_MATCH(claims["jti"]):
        return _malformed(index, "claim 'jti' must be letters, digits, '.', '_', ':' and '-' (it names a URL path)")
    for name in _CLAIM_TIMES:
        if not _is_time(claims.get(name)):
            return _malformed(index, f"claim {name!r} must be a NumericDate")
    if claims["nbf"] > claims["exp"]:
        return _malformed(index, "nbf is after exp")
    if not isinstance(claims.get("dpth"), int) or isinstance(claims["dpth"], bool) or claims["dpth"] < 0:
        return _malformed(index, "claim 'dpth' must be a non-negative integer")
    if "prf" in claims and not isinstance(claims["prf"], str):
        return _malformed(index, "claim 'prf' must be a string")
    try:
        split_caps(claims.get("caps"))
    except GrantError as exc:
        return _malformed(index, f"claim 'caps' must map capability names to 'direct', 'approval' or "
                          f"{{tier, calls, per_minute}}: {exc}")
    cnf = claims.get("cnf")
    if not isinstance(cnf, dict):
        return _malformed(index, "claim 'cnf' must hold the subject's jwk")
    try:
        keys.from_jwk(cnf.get("jwk"))
    except KeyError_ as exc:
        return _malformed(index, exc.message)
    if "d" in cnf["jwk"]:
        # The subject's private key, published in a token every sidecar and log sees: whoever reads the link
        # can sign as its subject. Never accepted, so a careless issuer finds out at once.
        return ChainInvalid("private_key_in_grant", f"link {index}: cnf.jwk carries a private key ('d'); a grant "
                            "names only the subject's public key. Treat that key as leaked: make a new one",
                            link=index)
    return _malformed(index, "the claims are not those of a grant link")


def split_chain(wire: str) -> list[str]:
    if not isinstance(wire, str) or not wire.strip():
        raise ChainInvalid("malformed", "the chain is empty")
    # Count before measuring: a long chain of real links is over the byte limit too, and "too many
    # links" is the more useful answer. Both checks run before anything is split or decoded.
    count = wire.count(",") + 1
    if count > MAX_LINKS:
        raise ChainInvalid("too_long", f"a chain has at most {MAX_LINKS} links, got {count}")
    if len(wire) > MAX_CHAIN_BYTES:
        raise ChainInvalid("too_large", f"a chain is at most {MAX_CHAIN_BYTES} bytes")
    return [part.strip() for part in wire.split(",")]


# -- verification ----------------------------------------------------------------------------------
class Verifier:
    """Verifies chains against the control plane's public key, with bounded caches."""

    def __init__(
        self,
        trust: Ed25519PublicKey,
        *,
        catalog_hash: str | None = None,
        leeway: float = LEEWAY_S,
        cache_size: int = 4096,
    ) -> None:
        self.trust_raw = keys.raw_public(trust)
        self.trust = trust
        self.catalog_hash = catalog_hash
        self.leeway = leeway
        self.cache_size = cache_size
        # Insertion-ordered dicts evicting their oldest entry: a bounded FIFO cache each.
        self._links: dict[str, tuple[Link, bytes]] = {}
        self._chains: dict[str, VerifiedChain] = {}

    def verify(
        self, chain: str | Sequence[str], *, now: float, revoked: Container[str] = ()
    ) -> VerifiedChain:
        """Full verification: structure and signatures (cached), then revocation and time (always)."""
        verified = self.structure(chain)
        verified.check(now, revoked, self.leeway)
        return verified

    def structure(self, chain: str | Sequence[str]) -> VerifiedChain:
        wire = chain if isinstance(chain, str) else ",".join(chain)
        cached = self._chains.get(wire)
        if cached is not None:
            return cached
        verified = self._verify_structure(split_chain(wire))
        self._remember(self._chains, wire, verified)
        return verified

    def _remember(self, cache: dict, key: str, value: Any) -> None:
        cache[key] = value
        if len(cache) > self.cache_size:
            del cache[next(iter(cache))]

    def _verify_structure(self, compacts: list[str]) -> VerifiedChain:
        # Three passes: decode every link, check the signatures not yet cached, then the rules between
        # links. Each link is still decoded before its signature is checked and its signature before its
        # rules; grouping the signature checks keeps OpenSSL's code and tables warm between them.
        links: list[Link] = []
        unsigned: list[int] = []
        for index, compact in enumerate(compacts):
            signer_raw = self.trust_raw if index == 0 else links[-1].key_raw
            # Only a well-formed (ASCII, bounded) link can be a cache hit; parse_link refuses the rest.
            digest = link_hash(compact) if len(compact) <= MAX_LINK_BYTES and compact.isascii() else ""
            cached = self._links.get(digest)
            if cached is not None and cached[1] == signer_raw:
                links.append(cached[0])
            else:
                links.append(parse_link(compact, index, digest or None))
                unsigned.append(index)
        for index in unsigned:
            link, parent = links[index], links[index - 1] if index else None
            key = self.trust if parent is None else parent.key
            try:
                key.verify(link.signature, link.signing_input)
            except InvalidSignature:
                who = "the control plane's key" if index == 0 else f"the key of link {index - 1}'s subject"
                raise ChainInvalid(
                    "bad_signature", f"link {index}: signature does not verify under {who}", link=index
                ) from None
            self._remember(self._links, link.hash, (link, self.trust_raw if parent is None else parent.key_raw))
        root = links[0]
        if root.prf is not None:
            raise ChainInvalid("broken_prf", "link 0 is a root link and must not carry prf", link=0)
        if self.catalog_hash is not None and root.cat != self.catalog_hash:
            raise ChainInvalid(
                "catalog_mismatch",
                f"the chain was issued against catalog {root.cat}, this deployment runs {self.catalog_hash}; "
                "re-issue it",
                link=0,
            )
        seen = {root.jti}
        for index in range(1, len(links)):
            link = links[index]
            _check_link(links[index - 1], link, index)
            if link.jti in seen:
                raise ChainInvalid("duplicate_link", f"link {index}: jti appears twice in the chain", link=index)
            seen.add(link.jti)
        # _check_link made each link's window nest in its parent's: the leaf's is the chain's.
        return VerifiedChain(tuple(links), nbf=links[-1].nbf, exp=links[-1].exp,
                             issued=max(link.iat for link in links))


def _check_link(parent: Link, link: Link, index: int) -> None:
    if link.iss != parent.sub:
        raise ChainInvalid(
            "issuer_mismatch", f"link {index}: iss {link.iss!r} is not the parent's subject {parent.sub!r}",
            link=index,
        )
    if link.prf != parent.hash:
        raise ChainInvalid("broken_prf", f"link {index}: prf does not name the parent link's hash", link=index)
    if link.cat != parent.cat:
        raise ChainInvalid("catalog_mismatch", f"link {index}: issued against another catalog", link=index)
    _check_narrowing(parent, link.caps, link.budgets, index)
    if link.nbf < parent.nbf:
        raise ChainInvalid("nbf_before_parent", f"link {index}: nbf is before the parent's", link=index)
    if link.exp > parent.exp:
        raise ChainInvalid("exp_exceeds_parent", f"link {index}: outlives its parent link", link=index)
    if link.dpth >= parent.dpth:
        reason = "depth_exhausted" if parent.dpth == 0 else "depth_not_decreasing"
        raise ChainInvalid(reason, f"link {index}: delegation depth must decrease and stay >= 0", link=index)


def parse_chain_unverified(wire: str | Sequence[str]) -> list[Link]:
    """Decode a chain's links without checking signatures (for display and lookups only)."""
    compacts = split_chain(wire if isinstance(wire, str) else ",".join(wire))
    return [parse_link(c, i) for i, c in enumerate(compacts)]
