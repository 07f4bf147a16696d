"""What both sides' processes share beyond the capability model: the call resolutions, and the file and
argument helpers their entry points use (``tether sidecar``, ``tether run``, ``tether controlplane serve``).

Pure or plain file I/O, no network: the sidecar imports this instead of the control plane's CLI and serving
modules, so a sidecar process loads nothing of the control plane's server, stores or commands (a test
holds it to that: tests/test_layers.py).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .budget import GrantError, parse_cap_spec
from .catalog import TIERS, Catalog, parse_catalog
from .errors import BAD_REQUEST, CATALOG_INVALID, FILE_EXISTS, TetherError

# What became of a call (docs/contract.md section 5): the sidecar resolves each call to one of these, the control
# plane records them. ``cancelled``: an MCP call the client cancelled or disconnected from after it left, before
# its answer reached it (the server may have acted on it; a re-send is a new call, ``reissue_of`` this one).
RESOLUTIONS = ("completed", "refused", "failed_not_sent", "cancelled_not_sent", "unknown", "cancelled")


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TetherError(f"cannot read {what} {path}: {exc.strerror}", code=BAD_REQUEST) from None


def read_chain(path: str) -> str:
    """A chain file: the links root first, comma- or newline-separated (as `grant issue/delegate` write it)."""
    text = read_file(path, "chain").decode("ascii", "replace").strip()
    return ",".join(part.strip() for part in text.replace("\n", ",").split(",") if part.strip())


def _durable_temp(directory: Path, name: str, data: bytes, mode: int) -> str:
    """``data`` in a new private file beside ``name`` in ``directory``, on disk (fsynced); its path."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")  # mode 600 from the start
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def publish_file(path: str, data: bytes, mode: int = 0o600) -> bool:
    """Create ``path`` holding ``data`` only if no file is there, atomically: a reader finds the whole file or
    none. The bytes are written to a private temporary file beside it and linked into place (``link`` fails
    when the name exists), so two processes creating one key at once end with one key, the first one's.
    False when the file already existed (it stands untouched)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _durable_temp(p.parent, p.name, data, mode)
    try:
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def replace_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably: a reader, or a restart after a crash, finds the
    old file or the new one whole, never a part."""
    os.replace(_durable_temp(path.parent, path.name, data, mode), path)


def write_secret(path: str, data: bytes) -> None:
    """Write a new file only its owner may read (mode 600). A file already there is refused, never replaced
    (``tether.file_exists``): an overwritten key silently invalidates everything it signed."""
    if not publish_file(path, data):
        raise TetherError(f"{path} already exists: not replacing it (a key that is replaced invalidates every "
                          "chain and record it signed; move it away first, or use --force where offered)",
                          code=FILE_EXISTS, path=path)


def set_aside(path: str, now: float) -> str | None:
    """Rename an existing file to ``PATH.replaced-YYYYmmddTHHMMSSZ`` (kept, never deleted); its new name."""
    if not os.path.lexists(path):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    kept = f"{path}.replaced-{stamp}"
    n = 1
    while os.path.lexists(kept):
        n += 1
        kept = f"{path}.replaced-{stamp}-{n}"
    os.rename(path, kept)
    return kept


def parse_caps(values: Sequence[str] | None) -> dict[str, Any]:
    """``--cap NAME=TIER[,calls=N][,per_minute=M]`` values as caps: a tier, or its claim object."""
    caps: dict[str, Any] = {}
    for value in values or []:
        try:
            name, grant = parse_cap_spec(value)
        except GrantError as exc:
            raise TetherError(f"{exc} (TIER one of {', '.join(TIERS)})", code=BAD_REQUEST) from None
        caps[name] = grant if isinstance(grant, str) else grant.claim()
    return caps


def parse_listen(value: str, default_port: int) -> tuple[str, int]:
    """``--listen HOST:PORT`` (or a bare host, or ``[v6]:PORT``)."""
    host, _, port = value.rpartition(":")
    if not host:
        host, port = value, str(default_port)
    try:
        number = int(port)
    except ValueError:
        raise TetherError(f"--listen {value}: expected HOST:PORT", code=BAD_REQUEST) from None
    if not 0 <= number < 65536:
        raise TetherError(f"--listen {value}: port out of range", code=BAD_REQUEST)
    return host.strip("[]"), number


def load_catalog(path: str) -> Catalog:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TetherError(f"cannot read the catalog {path}: {exc.strerror}", code=CATALOG_INVALID) from None
    return parse_catalog(text, path)
