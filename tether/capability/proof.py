"""Proof of possession: a request signed with a chain's key (sidecars, ancestor principals).

A proof is a compact JWS (``typ: tether-proof+jwt``, EdDSA) over the request's method, path and body
hash, fresh to within ``max_age`` seconds, with a unique ``jti`` the server remembers to stop replays.
It travels in the ``Tether-Proof`` header. Pure: the caller supplies the time and the key to check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import keys
from .chain import LEEWAY_S
from .errors import UNAUTHORIZED, ApiError
from .protocol import finite_number

PROOF_TYP = "tether-proof+jwt"
RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_AGE_S = 60
FUTURE_LEEWAY_S = LEEWAY_S  # a proof may be dated this far ahead: the clock skew tolerated for links too


def body_hash(body: bytes) -> str:
    return keys.b64url(hashlib.sha256(body).digest())


def make_proof(
    key: Ed25519PrivateKey, *, agent: str, method: str, path: str, body: bytes, now: float,
    link: str | None = None, run: str | None = None,
) -> str:
    """Sign a request. ``link`` is the hash of the link whose ``cnf`` is ``key``'s public half; ``run`` names
    the sidecar run making it (every sidecar start is a run: docs/contract.md section 10, Identity)."""
    claims: dict[str, Any] = {
        "sub": agent,
        "htm": method.upper(),
        "htu": path,
        "bh": body_hash(body),
        "iat": round(now, 3),
        "jti": os.urandom(12).hex(),
    }
    if link is not None:
        claims["lnk"] = link
    if run is not None:
        claims["run"] = run
    return keys.sign_jws(claims, key, PROOF_TYP)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, UNAUTHORIZED, message)


@dataclass(frozen=True)
class Proof:
    claims: dict[str, Any]
    signing_input: bytes
    signature: bytes

    @property
    def agent(self) -> str:
        return self.claims["sub"]

    @property
    def link(self) -> str | None:
        return self.claims.get("lnk")

    @property
    def run(self) -> str | None:
        return self.claims.get("run")

    @property
    def jti(self) -> str:
        return self.claims["jti"]


def read_proof(compact: str) -> Proof:
    """Decode a proof's form without checking its signature."""
    try:
        h, p, s = compact.split(".")
        header = json.loads(keys.b64url_decode(h))
        claims = json.loads(keys.b64url_decode(p))
        signature = keys.b64url_decode(s)
    except (ValueError, TypeError, RecursionError):
        raise _unauthorized("Tether-Proof is not a compact JWS") from None
    if not isinstance(header, dict) or header.get("alg") != "EdDSA" or header.get("typ") != PROOF_TYP:
        raise _unauthorized(f"Tether-Proof must be an EdDSA JWS of typ {PROOF_TYP}")
    if not isinstance(claims, dict) or not all(
        isinstance(claims.get(k), str) for k in ("sub", "htm", "htu", "bh", "jti")
    ) or not finite_number(claims.get("iat")):
        raise _unauthorized("Tether-Proof lacks sub, htm, htu, bh, jti or a finite numeric iat")
    if "run" in claims and not (isinstance(claims["run"], str) and RUN_ID.fullmatch(claims["run"])):
        raise _unauthorized("Tether-Proof names a malformed run id (1-64 of letters, digits, '.', '_', ':', '-')")
    return Proof(claims, f"{h}.{p}".encode("ascii"), signature)


def check_proof(
    proof: Proof, key: Ed25519PublicKey, *, method: str, path: str, body: bytes, now: float,
    max_age: float = MAX_AGE_S, leeway: float = FUTURE_LEEWAY_S,
) -> None:
    """Raise ApiError(401) unless ``proof`` signs exactly this request with ``key``, recently: at most
    ``max_age`` seconds ago and at most ``leeway`` seconds ahead of ``now`` (a proof dated further ahead
    would stay fresh past its age bound, and is what a pre-signed replay looks like)."""
    check_signed(proof, key, method=method, path=path, body=body)
    check_fresh(proof, now=now, max_age=max_age, leeway=leeway)


def check_signed(proof: Proof, key: Ed25519PublicKey, *, method: str, path: str, body: bytes) -> None:
    """The first half of ``check_proof``: ``proof`` signs exactly this request with ``key`` (so its ``iat``
    is the signer's word, worth comparing clocks with, before ``check_fresh`` judges it)."""
    try:
        key.verify(proof.signature, proof.signing_input)
    except InvalidSignature:
        raise _unauthorized("Tether-Proof signature does not verify under the key of the chain") from None
    c = proof.claims
    if c["htm"] != method.upper() or c["htu"] != path:
        raise _unauthorized("Tether-Proof was made for another request")
    if c["bh"] != body_hash(body):
        raise _unauthorized("Tether-Proof does not match the request body")


def check_fresh(proof: Proof, *, now: float, max_age: float = MAX_AGE_S, leeway: float = FUTURE_LEEWAY_S) -> None:
    """The second half of ``check_proof``: signed at most ``max_age`` seconds before ``now`` and at most
    ``leeway`` seconds after it."""
    # Written so that a NaN iat (JSON allows it) is stale rather than forever fresh.
    iat = float(proof.claims["iat"])
    if not now - max_age <= iat:
        raise _unauthorized(f"Tether-Proof is older than {max_age:.0f}s (or the clocks disagree)")
    if not iat <= now + leeway:
        raise _unauthorized(f"Tether-Proof is dated {iat - now:.0f}s in the future (more than the {leeway:.0f}s "
                            "clock leeway): check the signer's clock")


__all__ = ["FUTURE_LEEWAY_S", "MAX_AGE_S", "Proof", "body_hash", "check_fresh", "check_proof", "check_signed",
           "make_proof", "read_proof"]
