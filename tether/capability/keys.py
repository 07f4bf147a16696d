"""Ed25519 keys: generation, PEM and JWK forms, thumbprints. Bytes in, bytes out; no files here."""

from __future__ import annotations

import binascii
import hashlib
import json
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import KeyError_

_URL_TO_STD = bytes.maketrans(b"-_", b"+/")
_STD_TO_URL = bytes.maketrans(b"+/", b"-_")


def b64url(data: bytes) -> str:
    # binascii directly: base64.urlsafe_b64encode adds layers that cost more than the encoding itself
    return binascii.b2a_base64(data, newline=False).translate(_STD_TO_URL).rstrip(b"=").decode("ascii")


def sign_jws(claims: dict[str, Any], key: Ed25519PrivateKey, typ: str) -> str:
    """A compact JWS (EdDSA) of ``claims``: byte for byte what PyJWT's ``jwt.encode(claims, key, algorithm="EdDSA",
    headers={"typ": typ})`` writes (header keys sorted, no spaces; Ed25519 signatures are deterministic), without
    loading PyJWT in the sidecar (tests/test_chain.py compares the two)."""
    if "iss" in claims and not isinstance(claims["iss"], str):
        raise TypeError("Issuer (iss) must be a string.")
    header = b64url(json.dumps({"alg": "EdDSA", "typ": typ}, separators=(",", ":")).encode())
    signing_input = f"{header}.{b64url(json.dumps(claims, separators=(',', ':')).encode())}"
    return f"{signing_input}.{b64url(key.sign(signing_input.encode('ascii')))}"


def b64url_decode(text: str) -> bytes:
    """Decode unpadded base64url; as lenient as ``base64.urlsafe_b64decode`` (raises ValueError)."""
    if not isinstance(text, str):
        raise ValueError("expected base64url text")
    try:
        data = text.encode("ascii").translate(_URL_TO_STD)
    except UnicodeEncodeError:
        raise ValueError("string argument should contain only ASCII characters") from None
    return binascii.a2b_base64(data + b"=" * (-len(data) % 4))


def generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_private(data: bytes, source: str = "key") -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyError_(f"{source}: not a PEM private key ({exc})", source=source) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyError_(f"{source}: not an Ed25519 key; tether signs with Ed25519 only", source=source)
    return key


def load_public(data: bytes, source: str = "public key") -> Ed25519PublicKey:
    """A public key from PEM, or from JWK JSON (``{"kty":"OKP","crv":"Ed25519","x":...}``)."""
    text = data.strip()
    if text.startswith(b"{"):
        try:
            return from_jwk(json.loads(text))
        except (ValueError, KeyError_) as exc:
            raise KeyError_(f"{source}: not an Ed25519 JWK ({exc})", source=source) from None
    try:
        key = serialization.load_pem_public_key(text)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyError_(f"{source}: not a PEM public key ({exc})", source=source) from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyError_(f"{source}: not an Ed25519 key; tether accepts Ed25519 only", source=source)
    return key


def to_jwk(key: Ed25519PublicKey) -> dict[str, str]:
    return {"kty": "OKP", "crv": "Ed25519", "x": b64url(raw_public(key))}


def from_jwk(jwk: Any) -> Ed25519PublicKey:
    if not isinstance(jwk, dict) or jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise KeyError_("cnf.jwk must be an OKP Ed25519 JWK")
    try:
        raw = b64url_decode(jwk["x"])
        if len(raw) != 32:
            raise ValueError("x must be 32 bytes")
        return Ed25519PublicKey.from_public_bytes(raw)
    except (KeyError, ValueError, TypeError) as exc:
        raise KeyError_(f"cnf.jwk is not a valid Ed25519 key ({exc})") from None


def thumbprint(key: Ed25519PublicKey) -> str:
    """RFC 7638 JWK thumbprint: a stable short name for a key."""
    jwk = to_jwk(key)
    canonical = json.dumps({k: jwk[k] for k in ("crv", "kty", "x")}, separators=(",", ":"))
    return b64url(hashlib.sha256(canonical.encode()).digest())
