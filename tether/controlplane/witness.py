"""A witness (C2SP ``tlog-witness``): it keeps the last checkpoint it saw of each log it knows, and cosigns a
new checkpoint only when a consistency proof shows the new tree extends that one. A log that showed two
parties different histories (a fork), or rewrote or dropped its past, cannot get both cosigned.

``add_checkpoint`` is the whole decision, pure. ``WitnessServer`` is its thin edge: one aiohttp route,
``POST /add-checkpoint``, and a state file per log written atomically before the cosignature is returned (a
witness that cosigned and then forgot would cosign a fork after a restart).

Request body: ``old SIZE`` line, the consistency proof's hashes (base64, one per line), an empty line, then the
signed checkpoint note. Answers: 200 with the cosignature line; 400 malformed; 403 no known key of that log
signed it; 404 unknown log; 409 the old size is not the one the witness holds (body: that size, content type
``text/x.tlog.size``) or the same size with another root; 422 the proof does not verify.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability.shared import replace_file

from .merkle import EMPTY_ROOT, verify_consistency
from .notes import NoteError, Verifier, cosignature_line, open_checkpoint

SIZE_TYPE = "text/x.tlog.size"
MAX_BODY = 1 << 20
MAX_PROOF = 64  # a consistency proof of a tree of 2**63 leaves is shorter


@dataclass(frozen=True)
class Seen:
    """The last checkpoint a witness cosigned for one log."""

    size: int
    root: bytes

    def to_doc(self) -> dict[str, Any]:
        return {"size": self.size, "root": base64.b64encode(self.root).decode()}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Seen:
        return cls(int(doc["size"]), base64.b64decode(doc["root"]))


NEW_LOG = Seen(0, EMPTY_ROOT)


@dataclass(frozen=True)
class Answer:
    status: int
    body: str
    content_type: str = "text/plain; charset=utf-8"
    seen: Seen | None = None  # what to keep (before answering) when the witness cosigned


def _parse(body: str) -> tuple[int, list[bytes], str]:
    head, sep, note = body.partition("\n\n")
    if not sep:
        raise ValueError("the body is an old-size line, proof lines, an empty line and a checkpoint")
    lines = head.split("\n")
    if not lines[0].startswith("old ") or not lines[0][4:].isdigit():
        raise ValueError("the body starts with 'old SIZE'")
    if len(lines) - 1 > MAX_PROOF:
        raise ValueError(f"a consistency proof of more than {MAX_PROOF} hashes")
    proof = [base64.b64decode(line, validate=True) for line in lines[1:]]
    if any(len(h) != 32 for h in proof):
        raise ValueError("a proof line is not a base64 SHA-256 hash")
    return int(lines[0][4:]), proof, note


def add_checkpoint(body: str, logs: Mapping[str, Verifier], seen: Mapping[str, Seen], name: str,
                   key: Ed25519PrivateKey, now: int) -> Answer:
    """The witness's decision on one add-checkpoint request. ``logs``: origin -> the log's note key;
    ``seen``: origin -> the last checkpoint cosigned (absent: the log is new to the witness)."""
    try:
        old, proof, note = _parse(body)
    except ValueError as exc:
        return Answer(400, f"{exc}\n")
    origin = note.split("\n", 1)[0]
    log = logs.get(origin)
    if log is None:
        return Answer(404, f"unknown log {origin!r}\n")
    try:
        checkpoint, parsed = open_checkpoint(note, log)
    except NoteError as exc:
        return Answer(403, f"{exc}\n")
    last = seen.get(origin, NEW_LOG)
    if old != last.size:
        return Answer(409, f"{last.size}\n", SIZE_TYPE)
    if checkpoint.size < old:
        return Answer(400, f"the checkpoint's size {checkpoint.size} is smaller than the old size {old}\n")
    if checkpoint.size == old and checkpoint.root != last.root:
        return Answer(409, f"{last.size}\n", SIZE_TYPE)  # same size, another tree: a fork
    if checkpoint.size > old and not verify_consistency(old, checkpoint.size, last.root, checkpoint.root, proof):
        return Answer(422, f"the consistency proof from {old} to {checkpoint.size} does not verify\n")
    line = cosignature_line(parsed.text, name, key, now)
    return Answer(200, line, "text/x.tlog.cosignature", Seen(checkpoint.size, checkpoint.root))


# -- the edge ------------------------------------------------------------------------------------------------
class WitnessState:
    """One JSON file per log in ``directory``, replaced atomically (written, fsynced, renamed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, origin: str) -> Path:
        return self.directory / (base64.urlsafe_b64encode(origin.encode()).decode().rstrip("=") + ".json")

    def load(self, origins: list[str]) -> dict[str, Seen]:
        out = {}
        for origin in origins:
            path = self._path(origin)
            if path.exists():
                out[origin] = Seen.from_doc(json.loads(path.read_text()))
        return out

    def keep(self, origin: str, seen: Seen) -> None:
        replace_file(self._path(origin), json.dumps({"origin": origin, **seen.to_doc()}).encode(), 0o600)


class WitnessServer:
    def __init__(self, name: str, key: Ed25519PrivateKey, logs: Mapping[str, Verifier], state: WitnessState,
                 clock: Any) -> None:
        import asyncio

        self.name, self.key, self.logs, self.state, self.clock = name, key, dict(logs), state, clock
        self.seen = state.load(list(self.logs))
        self.lock = asyncio.Lock()  # one decision at a time: two requests for one log must serialise

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/add-checkpoint", self.h_add_checkpoint)
        return app

    async def h_add_checkpoint(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = (await request.read()).decode("utf-8")
        except UnicodeDecodeError:
            return web.Response(status=400, text="the body is not UTF-8\n")
        async with self.lock:
            answer = add_checkpoint(body, self.logs, self.seen, self.name, self.key, int(self.clock()))
            if answer.seen is not None:
                origin = body.partition("\n\n")[2].split("\n", 1)[0]
                self.state.keep(origin, answer.seen)
                self.seen[origin] = answer.seen
        return web.Response(status=answer.status, body=answer.body.encode(),
                            content_type=answer.content_type.split(";")[0], charset="utf-8")
