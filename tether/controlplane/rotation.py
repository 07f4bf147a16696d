"""Signing-key rotation announced in the record log itself, so the log verifies across it.

A rotation is a record like the others (hashed, chained, signed with the key in force) whose ``kind`` is
``key_rotation``: it names the old key and the new one, and the new key signs it too (``new_key_signature``,
over the record's hash before that field was added). From it on, records are signed with the new key. Who
trusts either key can follow the log: before the first rotation the signer is that rotation's old key, after
each rotation its new key, and the trusted key must be one of them. The cross-signature means that holding
only the old key (the reason to rotate, often) is not enough to announce a rotation to a key of one's own.

Pure: records and keys in, verdicts out. ``tether keys rotate`` (tether/cli/keys.py) writes the record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tether.capability import keys
from tether.capability.errors import TetherError

KEY_ROTATION = "key_rotation"
BAD_KEY = (TetherError, KeyError, TypeError, ValueError)  # what reading a record's JWK can raise
NEW_KEY_SIGNATURE = "new_key_signature"
Doc = dict[str, Any]


def is_rotation(record: Mapping[str, Any]) -> bool:
    return record.get("kind") == KEY_ROTATION


def rotation_record(*, record_id: str, prev_hash: str, old: Any, new: Any, by: str, reason: str,
                    now: float) -> Doc:
    """The rotation's record, unsigned and not yet cross-signed (``cross_sign``, then ``termination.seal``
    with the old key). It carries the empty fields every record has, so every reader of the log reads it."""
    return {
        "record_id": record_id, "kind": KEY_ROTATION, "termination_id": None, "subject": "the signing key",
        "mode": KEY_ROTATION, "requested_by": by, "operator": None, "requested_at": now, "completed_at": now,
        "window_s": 0, "reason": reason, "calls": [], "leases": [], "agents_terminated": [],
        "agents_unaccounted": [], "acknowledgements": {},
        "old_key": keys.to_jwk(old.public_key()), "old_key_id": keys.thumbprint(old.public_key()),
        "new_key": keys.to_jwk(new.public_key()), "new_key_id": keys.thumbprint(new.public_key()),
        "prev_hash": prev_hash,
    }


def _content_hash(record: Mapping[str, Any]) -> str:
    from .termination import record_hash

    return record_hash({k: v for k, v in record.items() if k not in (NEW_KEY_SIGNATURE, "key_id")})


def cross_sign(record: Doc, new: Any) -> Doc:
    """The rotation record with the new key's signature over its content."""
    return {**record, NEW_KEY_SIGNATURE: keys.b64url(new.sign(_content_hash(record).encode("ascii")))}


def _signed(public: Any, signature: str, message: str) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        public.verify(keys.b64url_decode(signature), message.encode())
    except (InvalidSignature, ValueError):
        return False
    return True


def _same(a: Any, b: Any) -> bool:
    return keys.raw_public(a) == keys.raw_public(b)


def signers(records: Sequence[Mapping[str, Any]], trusted: Any) -> tuple[list[Any], list[str]]:
    """The key that must have signed each record (by position), and what is wrong with the log's rotations:
    a rotation whose old key is not the key then in force, one the new key did not sign, or a trusted key that
    signs no part of the log."""
    problems: list[str] = []
    rotations = [(i, r) for i, r in enumerate(records) if is_rotation(r)]
    if not rotations:
        return [trusted] * len(records), problems
    try:
        current = keys.from_jwk(rotations[0][1]["old_key"])
    except BAD_KEY:  # a malformed key is a problem of the record, said below
        current = None
    chain: list[Any] = [current] if current is not None else []
    out: list[Any] = []
    for index, record in enumerate(records):
        out.append(current)
        if not is_rotation(record):
            continue
        rid = record.get("record_id", f"#{index}")
        try:
            old, new = keys.from_jwk(record["old_key"]), keys.from_jwk(record["new_key"])
        except BAD_KEY:
            problems.append(f"record {index} ({rid}): a key rotation whose keys are unreadable")
            continue
        if current is None or not _same(old, current):
            problems.append(f"record {index} ({rid}): a key rotation from a key that was not in force")
        # A header read from a store (online verification) has no ``calls``: a rotation's are none (its hash over
        # its stored entries is checked apart), so its content is the header with ``calls: []``.
        if not _signed(new, str(record.get(NEW_KEY_SIGNATURE, "")), _content_hash({"calls": [], **record})):
            problems.append(f"record {index} ({rid}): the new key did not sign its own rotation")
        current = new
        chain.append(new)
    if not any(_same(k, trusted) for k in chain):
        problems.append(f"the trusted key ({keys.thumbprint(trusted)}) is none of the keys that signed this log "
                        f"({', '.join(keys.thumbprint(k) for k in chain)})")
    return out, problems


def key_in_force(head: Mapping[str, Any] | None, public: Any) -> bool:
    """Whether ``public`` is the key that signs the record after ``head`` (a rotation's new key, else the key
    that signed the head). No head: any key starts a log."""
    if head is None:
        return True
    if is_rotation(head):
        try:
            return _same(keys.from_jwk(head["new_key"]), public)
        except BAD_KEY:
            return False
    return _signed(public, str(head.get("signature", "")), str(head.get("hash", "")))
