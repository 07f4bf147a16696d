"""Signed checkpoints of the record log, and where they go.

The record log is a Merkle tree (``tether/controlplane/merkle.py``) whose leaves are the records' hashes, in log
order. A checkpoint (C2SP ``tlog-checkpoint``) names the log (its origin), its size and its root, and is
signed with the control plane's key as a C2SP signed note whose key name is the origin. Whoever holds a
checkpoint can later prove that the log they are shown is exactly the first ``size`` records of the log it
committed to: a dropped tail, a rewritten past or a fork are caught (``tether records verify --checkpoint``).

Checkpoints leave the box: after each new record (and every ``idle_s`` while nothing happens) each configured
sink receives the latest one: an append-only directory (``checkpoint.SIZE`` files and ``latest``, a link to
the newest: put it on a WORM mount) and witnesses speaking C2SP ``tlog-witness`` (``tether witness serve``),
whose cosignatures are kept beside it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability.shared import publish_file, replace_file

from ..merkle import ProofError, Tree, record_leaf
from ..notes import Checkpoint, Verifier, signed_checkpoint, with_lines
from ..store import Store

log = logging.getLogger("tether.checkpoints")
DEFAULT_ORIGIN = "tether/records"


@dataclass
class Witness:
    """A witness the checkpoints are sent to, and the size it last cosigned (learned from its 409s)."""

    url: str
    size: int = 0
    cosigned: str = ""  # its last cosignature line


@dataclass
class CheckpointService:
    store: Store
    signing_key: Ed25519PrivateKey
    origin: str = DEFAULT_ORIGIN
    directory: Path | None = None
    witnesses: list[Witness] = field(default_factory=list)
    interval_s: float = 1.0
    idle_s: float = 60.0
    clock: Callable[[], float] = time.time
    _tree: Tree | None = None
    _published: tuple[int, float] = (-1, 0.0)  # (size, when)
    _last: tuple[int, str, int] | None = None  # the tree's last record: (its position in the store, hash, tree size)

    def verifier(self) -> Verifier:
        return Verifier(self.origin, self.signing_key.public_key())

    async def tree(self, heads: list[Any] | None = None, *, full: bool = True) -> Tree:
        """The log's tree; ``heads``: the record headers when the caller has read them already. Not ``full``:
        only the records from the last one the tree holds are read (found by its position in the store, not
        by counting the records before it), and the tree extended when that one is unchanged (a log that
        shrank or changed there is read whole, and so is one the tree grew from ``heads`` since)."""
        tree, last = self._tree, self._last
        if heads is None and not full and tree is not None and tree.size and last is not None and last[2] == tree.size:
            tail = await self.store.heads_from(last[0])
            if tail and tail[0][0] == last[0] and tail[0][1]["hash"] == last[1]:
                tree.extend([record_leaf(h["hash"]) for _, h in tail[1:]])
                self._last = (tail[-1][0], tail[-1][1]["hash"], tree.size)
                return tree
        if heads is None:
            placed = await self.store.heads_from(0)
            heads = [h for _, h in placed]
            self._last = (placed[-1][0], placed[-1][1]["hash"], len(placed)) if placed else None
        leaves = [record_leaf(h["hash"]) for h in heads]
        if tree is not None and tree.leaves == leaves[:tree.size]:  # the log grew (or did not): extend
            tree.extend(leaves[tree.size:])
        else:  # a first look, or a log that is not what it was (a restore): build again
            self._tree = tree = Tree(leaves)
        return tree

    async def checkpoint(self, tree: Tree | None = None) -> str:
        tree = await self.tree() if tree is None else tree
        return signed_checkpoint(Checkpoint(self.origin, tree.size, tree.root()), self.origin, self.signing_key)

    async def inclusion(self, record_id: str, size: int | None) -> dict[str, Any]:
        heads = await self.store.record_heads()
        index = next((i for i, h in enumerate(heads) if record_id in (h["record_id"], h.get("termination_id"))),
                     None)
        if index is None:
            raise ProofError(f"no record {record_id}")
        tree = await self.tree(heads)
        size = tree.size if size is None else size
        proof = tree.inclusion_proof(index, size)
        return {"record_id": heads[index]["record_id"], "record_hash": heads[index]["hash"], "index": index,
                "size": size, "root": _b64(tree.root(size)), "proof": [_b64(h) for h in proof]}

    async def consistency(self, first: int, second: int | None) -> dict[str, Any]:
        tree = await self.tree()
        second = tree.size if second is None else second
        proof = tree.consistency_proof(first, second) if first else []
        return {"first": first, "second": second, "proof": [_b64(h) for h in proof]}

    # -- sinks --------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Publish a checkpoint whenever the log grew, and every ``idle_s`` anyway."""
        while True:
            try:
                await self.publish_if_due()
            except Exception:  # a sink that fails must not stop the others, nor this loop
                log.exception("publishing a checkpoint failed; trying again")
            await asyncio.sleep(self.interval_s)

    async def publish_if_due(self) -> bool:
        from .. import telemetry

        traced = telemetry.tracer("tether-controlplane") is not None
        if self.directory is None and not self.witnesses and not traced:
            return False
        size, when = self._published
        idle = self.clock() - when >= self.idle_s
        tree = await self.tree(full=idle)  # the whole log read once per idle period, what is new every second
        if tree.size == size and not idle:
            return False
        note = await self.checkpoint(tree)
        lines = [line for w in self.witnesses if (line := await self._witness(w, tree, note))]
        if self.directory is not None:
            await asyncio.to_thread(self._keep, tree.size, with_lines(note, lines))
        telemetry.checkpoint(self.origin, tree.size, _b64(tree.root()), with_lines(note, lines), self.clock())
        self._published = (tree.size, self.clock())
        return True

    def _keep(self, size: int, note: str) -> None:
        assert self.directory is not None
        keep_checkpoint(self.directory, size, note)

    async def _witness(self, witness: Witness, tree: Tree, note: str) -> str:
        import httpx

        for _ in range(2):  # a 409 tells the size the witness holds: one more try from there
            old = min(witness.size, tree.size)
            proof = tree.consistency_proof(old, tree.size) if 0 < old < tree.size else []
            body = f"old {old}\n" + "".join(f"{_b64(h)}\n" for h in proof) + "\n" + note
            try:
                async with httpx.AsyncClient(timeout=10) as http:
                    resp = await http.post(witness.url.rstrip("/") + "/add-checkpoint", content=body.encode())
            except httpx.HTTPError as exc:
                log.warning("witness %s unreachable: %s", witness.url, exc)
                return ""
            if resp.status_code == 200:
                witness.size, witness.cosigned = tree.size, resp.text
                return resp.text
            if resp.status_code == 409 and resp.text.strip().isdigit() and int(resp.text) != old:
                witness.size = int(resp.text)
                if witness.size > tree.size:  # it cosigned more of this log than the log now holds
                    log.error("witness %s cosigned %d records of %s but the log holds %d: records were lost or "
                              "rolled back (a restored backup?); it will not cosign this log until that is "
                              "resolved", witness.url, witness.size, self.origin, tree.size)
                    return ""
                continue
            log.error("witness %s refused checkpoint %d: %s", witness.url, tree.size,
                      _refusal(resp.status_code, resp.text, old, tree.size))
            return ""
        return ""


def keep_checkpoint(directory: Path, size: int, note: str) -> None:
    """The directory sink: ``checkpoint.SIZE``, written once and never rewritten (append-only: a WORM mount),
    durably (one fsync), and ``latest``, a relative symbolic link to it, replaced atomically (a rename: no
    data to write). A note of a size already kept that differs from the kept one (the same checkpoint with
    other cosignatures, from a later publication) is kept as ``latest`` itself, a file, as before."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"checkpoint.{size}"
    target, data = directory / name, note.encode()
    if (target.exists() or not publish_file(str(target), data, 0o644)) and target.read_bytes() != data:
        replace_file(directory / "latest", data)  # a size kept before, with another note: the file stays
        return
    link = directory / f".latest.{os.getpid()}.{size}"
    link.unlink(missing_ok=True)
    os.symlink(name, link)
    os.replace(link, directory / "latest")


def _refusal(status: int, text: str, old: int, size: int) -> str:
    """What a witness's refusal means for this log, in words a responder can act on."""
    if status == 409 and old == size:
        return (f"it holds another log of the same size {size}: this log is not the one it cosigned (a history "
                "rewritten with the signing key, or a fork shown to another party); it will not cosign it")
    if status == 422:
        return (f"this log does not extend the {old} records it cosigned (a history rewritten with the signing "
                f"key, or a fork): {text.strip()[:200]}")
    return f"{status} {text.strip()[:200]}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
