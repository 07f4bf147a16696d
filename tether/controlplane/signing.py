"""Which key extends the record log: a control plane starts only with the key that signed the log's head.

A replaced signing key (``tether keygen`` over the file, a Secret mounted from the wrong place) would otherwise
sign new records that ``tether records verify`` rejects and new chains no sidecar of the old trust accepts, with
nothing said at start-up. Pure: the caller reads the head record from the store.
"""

from __future__ import annotations

from typing import Any

from tether.capability import keys
from tether.capability.errors import SIGNING_KEY_MISMATCH, TetherError

Doc = dict[str, Any]


def signs(record: Doc, public_key: Any) -> bool:
    """Whether ``record``'s signature verifies under ``public_key`` (its hash is checked by records verify)."""
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(keys.b64url_decode(str(record.get("signature", ""))), str(record.get("hash", "")).encode())
    except (InvalidSignature, ValueError):
        return False
    return True


def check_head(head: Doc | None, public_key: Any, key_path: str) -> None:
    """Refuse (``tether.signing_key_mismatch``) a key that did not sign the log's last record."""
    from .rotation import is_rotation, key_in_force

    if key_in_force(head, public_key):
        return
    assert head is not None
    ours = keys.thumbprint(public_key)
    theirs = head.get("key_id") or "a key the record does not name (written before records named their key)"
    if is_rotation(head):
        theirs = f"a rotation to key {head.get('new_key_id')}"
    raise TetherError(
        f"the signing key {key_path} (key id {ours}) did not sign the last record of this store's log "
        f"({head.get('record_id', '?')}, signed by {theirs}): starting would write records that do not verify. "
        "Point --signing-key at the key that signed the log, or rotate keys with `tether keys rotate`",
        code=SIGNING_KEY_MISMATCH, key_id=ours, log_key_id=head.get("key_id"))
