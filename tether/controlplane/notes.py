"""Signed checkpoints of the record log as C2SP texts: ``signed-note`` (a text and signature lines),
``tlog-checkpoint`` (origin, size, root hash) and ``tlog-cosignature`` (a witness's timestamped signature).

Pure: bytes and keys in, bytes out. Formats, from the C2SP specifications:

- a note is UTF-8 text of one or more lines, each ending in ``\\n``, then a blank line, then one line per
  signature: ``— NAME BASE64(KEY_ID || SIGNATURE)``, where ``—`` is U+2014 EM DASH;
- an Ed25519 key's id is the first 4 bytes of SHA-256(NAME || ``\\n`` || 0x01 || PUBLIC_KEY), and its verifier
  key is written ``NAME+HEX(KEY_ID)+BASE64(0x01 || PUBLIC_KEY)``; it signs the note's text, final newline
  included;
- a checkpoint's text is ``ORIGIN\\nSIZE\\nBASE64(ROOT)\\n`` and optional extension lines;
- a cosignature (type 0x04) signs ``cosignature/v1\\ntime T\\n`` followed by the checkpoint's text, and its
  line carries BASE64(KEY_ID || T as 8 big-endian bytes || SIGNATURE).
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tether.capability import keys

DASH = "\u2014"
ED25519, COSIGNATURE_V1 = 0x01, 0x04
_NAME = re.compile(r"[^\s+]+")


class NoteError(ValueError):
    """A note, checkpoint or key that is not in its format, or a signature that does not verify."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise NoteError(f"{what}: not base64") from None


def key_id(name: str, public: Ed25519PublicKey, kind: int = ED25519) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([kind]) + keys.raw_public(public)).digest()[:4]


@dataclass(frozen=True)
class Verifier:
    """A named Ed25519 key that signs notes (kind 0x01) or cosignatures (kind 0x04)."""

    name: str
    public: Ed25519PublicKey
    kind: int = ED25519

    @property
    def id(self) -> bytes:
        return key_id(self.name, self.public, self.kind)

    def vkey(self) -> str:
        """The verifier key text: ``NAME+HEX(KEY_ID)+BASE64(KIND || PUBLIC_KEY)``."""
        return f"{self.name}+{self.id.hex()}+{_b64(bytes([self.kind]) + keys.raw_public(self.public))}"


def parse_vkey(text: str) -> Verifier:
    try:
        name, hexid, material = text.strip().split("+", 2)  # base64 has "+" too
        raw = _unb64(material, "verifier key")
        if len(raw) != 33 or raw[0] not in (ED25519, COSIGNATURE_V1) or not _NAME.fullmatch(name):
            raise ValueError
        public = Ed25519PublicKey.from_public_bytes(raw[1:])
    except ValueError:
        raise NoteError(f"not a verifier key (NAME+HEXID+BASE64): {text.strip()[:80]!r}") from None
    verifier = Verifier(name, public, raw[0])
    if verifier.id.hex() != hexid:
        raise NoteError(f"verifier key {name}: its key id {hexid} is not the hash of its key")
    return verifier


def _check_text(text: str) -> None:
    if not text.endswith("\n") or "\n\n" in text or text.startswith("\n"):
        raise NoteError("a note's text is one or more lines, each ending in a newline, none empty")


def sign_note(text: str, name: str, key: Ed25519PrivateKey, kid: bytes | None = None) -> str:
    """``text`` with one signature line by ``key`` under ``name`` (``kid``: its key id, when the caller keeps
    it: ``key_id(name, key.public_key())``)."""
    _check_text(text)
    if not _NAME.fullmatch(name):
        raise NoteError(f"a key name has no spaces or '+': {name!r}")
    signature = key.sign(text.encode())
    kid = key_id(name, key.public_key()) if kid is None else kid
    return f"{text}\n{DASH} {name} {_b64(kid + signature)}\n"


@dataclass(frozen=True)
class Note:
    text: str
    signatures: tuple[tuple[str, bytes], ...]  # (name, key id || signature bytes)


def parse_note(note: str) -> Note:
    text, sep, sigs = note.partition("\n\n")
    if not sep:
        raise NoteError("a signed note has its text, a blank line, then signature lines")
    text += "\n"
    _check_text(text)
    lines = sigs.split("\n")
    if lines[-1] != "" or len(lines) < 2:
        raise NoteError("a signed note ends with its last signature line and a newline")
    signatures = []
    for line in lines[:-1]:
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != DASH:
            raise NoteError(f"not a signature line: {line[:80]!r}")
        raw = _unb64(parts[2], f"signature of {parts[1]}")
        if len(raw) < 5:
            raise NoteError(f"signature of {parts[1]}: too short")
        signatures.append((parts[1], raw))
    return Note(text, tuple(signatures))


def verify_note(note: str, verifier: Verifier) -> Note:
    """The note, if ``verifier`` signed it (a line with its name and key id whose signature verifies)."""
    parsed = parse_note(note)
    for name, raw in parsed.signatures:
        if name == verifier.name and raw[:4] == verifier.id and verifier.kind == ED25519:
            try:
                verifier.public.verify(raw[4:], parsed.text.encode())
                return parsed
            except InvalidSignature:
                raise NoteError(f"the signature of {name} does not verify") from None
    raise NoteError(f"the note carries no signature by {verifier.name} (key id {verifier.id.hex()})")


# -- checkpoints ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        return "".join(f"{line}\n" for line in (self.origin, str(self.size), _b64(self.root), *self.extensions))


def parse_checkpoint(text: str) -> Checkpoint:
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "":
        raise NoteError("a checkpoint's text is its origin, size and root hash, one per line")
    origin, size, root, *extensions = lines[:-1]
    if not origin or not size.isdigit() or (size != "0" and size.startswith("0")):
        raise NoteError(f"a checkpoint's origin is not empty and its size a decimal number: {size!r}")
    digest = _unb64(root, "checkpoint root")
    if len(digest) != 32:
        raise NoteError("a checkpoint's root is a 32-byte SHA-256 hash")
    return Checkpoint(origin, int(size), digest, tuple(extensions))


def signed_checkpoint(checkpoint: Checkpoint, name: str, key: Ed25519PrivateKey, kid: bytes | None = None) -> str:
    return sign_note(checkpoint.text(), name, key, kid)


def open_checkpoint(note: str, verifier: Verifier) -> tuple[Checkpoint, Note]:
    """The checkpoint a note signed by ``verifier`` carries."""
    parsed = verify_note(note, verifier)
    return parse_checkpoint(parsed.text), parsed


# -- cosignatures (a witness's) -------------------------------------------------------------------------------
def _cosigned_message(checkpoint_text: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n{checkpoint_text}".encode()


def cosignature_line(checkpoint_text: str, name: str, key: Ed25519PrivateKey, timestamp: int) -> str:
    """The witness's signature line for a checkpoint it checked (tlog-cosignature)."""
    kid = key_id(name, key.public_key(), COSIGNATURE_V1)
    signature = key.sign(_cosigned_message(checkpoint_text, timestamp))
    return f"{DASH} {name} {_b64(kid + struct.pack('>Q', timestamp) + signature)}\n"


def verify_cosignature(note: Note, witness: Verifier) -> int:
    """The time at which ``witness`` cosigned the note's checkpoint; NoteError when it did not."""
    if witness.kind != COSIGNATURE_V1:
        raise NoteError(f"{witness.name} is not a cosignature key (type 0x04)")
    for name, raw in note.signatures:
        if name == witness.name and raw[:4] == witness.id and len(raw) == 4 + 8 + 64:
            timestamp = struct.unpack(">Q", raw[4:12])[0]
            try:
                witness.public.verify(raw[12:], _cosigned_message(note.text, timestamp))
            except InvalidSignature:
                raise NoteError(f"the cosignature of {name} does not verify") from None
            return int(timestamp)
    raise NoteError(f"no cosignature by {witness.name} (key id {witness.id.hex()})")


def with_lines(note: str, lines: list[str]) -> str:
    """A signed note with more signature lines (a witness's cosignatures) appended."""
    return note + "".join(line if line.endswith("\n") else line + "\n" for line in lines)
