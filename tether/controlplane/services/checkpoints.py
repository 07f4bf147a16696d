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

The directory commits in groups (``checkpoint_dir.DirectorySink``): a checkpoint costs the loop a journal
line; its file is written, with the others issued since, and made durable in one batch every ``sync_s`` (in a
worker thread) and at shutdown; one that is served is written first. A checkpoint is a function of the log
alone, so the store's log is its durable source: on start, every file past the last batch that a kill never
wrote or a machine crash left torn is written from the log (docs/audit.md, "Durability of the directory sink").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..merkle import ProofError, Tree, record_leaf
from ..notes import Checkpoint, Verifier, key_id, signed_checkpoint, with_lines
from ..store import Store
from .checkpoint_dir import DEFAULT_SYNC_S, DirectorySink

__all__ = ["DEFAULT_ORIGIN", "DEFAULT_SYNC_S", "CheckpointService", "DirectorySink", "Witness"]

log = logging.getLogger("tether.checkpoints")
DEFAULT_ORIGIN = "tether/records"
PENDING_MAX = 10_000  # appended headers kept for the next checkpoint; past this, the log is read instead


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
    sync_s: float = DEFAULT_SYNC_S  # the directory sink's batch: its files made durable at most this often
    clock: Callable[[], float] = time.time
    _tree: Tree | None = None
    _published: tuple[int, float] = (-1, 0.0)  # (size, when)
    # The last record the tree read from the store: (its position there, hash, tree size then); records this
    # process appended since may follow it in the tree (taken from ``_pending``).
    _last: tuple[int, str, int] | None = None
    _head: str = ""  # the hash of the tree's last record ("" for none)
    _pending: list[tuple[str, str]] = field(default_factory=list)  # (prev_hash, hash) appended here since
    _overflow: bool = False
    _sink: DirectorySink | None = None
    _kid: bytes | None = None  # the note key's id, computed once
    _http: Any = None  # the witnesses' HTTP client (httpx.AsyncClient), made on first use

    def __post_init__(self) -> None:
        self.store.on_append(self._appended)

    def verifier(self) -> Verifier:
        return Verifier(self.origin, self.signing_key.public_key())

    def _appended(self, header: dict[str, Any]) -> None:
        """The store appended a record in this process: its leaf for the next checkpoint, without reading it
        back (bounded: a loop that does not publish falls back to reading the log)."""
        if len(self._pending) < PENDING_MAX:
            self._pending.append((header["prev_hash"], header["hash"]))
        else:
            self._overflow = True

    def _take_pending(self) -> Tree | None:
        """The tree extended by the records this process appended since it last grew, if they follow its last
        record one after another (each append checked its ``prev_hash`` against the store's head, so they are
        the log's next records); None when there are none, or another writer's records came between: the
        store is read then."""
        pending, overflow, tree = self._pending, self._overflow, self._tree
        self._pending, self._overflow = [], False
        if not pending or overflow or tree is None or pending[0][0] != self._head:
            return None
        if any(prev != before for (prev, _), (_, before) in zip(pending[1:], pending, strict=False)):
            return None
        tree.extend([record_leaf(h) for _, h in pending])
        self._head = pending[-1][1]
        return tree

    def sink(self) -> DirectorySink | None:
        """The directory sink for ``directory`` (set by the CLI after construction), made on first use."""
        if self.directory is None:
            return None
        if self._sink is None or self._sink.path != self.directory:
            self._sink = DirectorySink(self.directory, sign=self._signed)
        self._sink.sync_s = self.sync_s
        return self._sink

    async def tree(self, heads: list[Any] | None = None, *, full: bool = True) -> Tree:
        """The log's tree; ``heads``: the record headers when the caller has read them already. Not ``full``:
        only the records from the last one the tree holds are read (found by its position in the store, not
        by counting the records before it), and the tree extended when that one is unchanged (a log that
        shrank or changed there is read whole, and so is one the tree grew from ``heads`` since)."""
        tree, last = self._tree, self._last
        if heads is None and not full and tree is not None and tree.size and last is not None and last[2] <= tree.size:
            tail = await self.store.heads_from(last[0])
            known = tree.size - last[2]  # records past the last one read that the tree took in-process
            if (len(tail) > known and tail[0][0] == last[0] and tail[0][1]["hash"] == last[1]
                    and all(record_leaf(h["hash"]) == leaf
                            for (_, h), leaf in zip(tail[1:known + 1], tree.leaves[last[2]:], strict=True))):
                tree.extend([record_leaf(h["hash"]) for _, h in tail[known + 1:]])
                self._last = (tail[-1][0], tail[-1][1]["hash"], tree.size)
                self._head = tail[-1][1]["hash"]
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
            if self._last is not None and self._last[2] > tree.size:
                self._last = None  # read from a longer log: not a place to read on from
        self._head = heads[-1]["hash"] if heads else ""
        return tree

    async def checkpoint(self, tree: Tree | None = None) -> str:
        """The log's checkpoint now, as served (``GET /v1/records/checkpoint``): with a directory sink, its file
        is written first, and any the batch has not written yet, so ``latest`` never names an older one than
        a reader was served."""
        tree = await self.tree() if tree is None else tree
        note = self._note(tree, tree.size)
        sink = self.sink()
        if sink is not None:
            self._ready(sink, tree)
            if tree.size > sink.newest():
                sink.keep(tree.size, note)
            await self._flush(sink)
        return note

    def _ready(self, sink: DirectorySink, tree: Tree) -> None:
        """Before the directory's first checkpoint from this process: what a kill or a crash left of the last
        batch written from the log."""
        if not sink.recovered:
            sink.recover(tree, lambda n: self._note(tree, n), self.verifier())

    async def _flush(self, sink: DirectorySink) -> None:
        """The files of the checkpoints issued and not yet written, written now (in a worker thread)."""
        notes = sink.take_queued()
        if notes:
            try:
                sink.written(await asyncio.to_thread(sink.write, notes))
            except BaseException:
                sink.give_back((notes, []))
                raise

    def _note(self, tree: Tree, size: int) -> str:
        return self._signed(size, tree.root(size))

    def _signed(self, size: int, root: bytes) -> str:
        if self._kid is None:
            self._kid = key_id(self.origin, self.signing_key.public_key())
        return signed_checkpoint(Checkpoint(self.origin, size, root), self.origin, self.signing_key, self._kid)

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
        """Publish a checkpoint whenever the log grew, and every ``idle_s`` anyway; the directory's batch made
        durable every ``sync_s``, and at once when the loop ends (a shutdown cancels it)."""
        try:
            while True:
                try:
                    await self.publish_if_due()
                    await self.sync_if_due()
                except Exception:  # a sink that fails must not stop the others, nor this loop
                    log.exception("publishing a checkpoint failed; trying again")
                await asyncio.sleep(self.interval_s)
        finally:
            self.sync_now()
            if self._http is not None:
                with contextlib.suppress(Exception):
                    await self._http.aclose()
                self._http = None

    async def publish_if_due(self) -> bool:
        from .. import telemetry

        traced = telemetry.tracer("tether-controlplane") is not None
        sink = self.sink()
        if sink is None and not self.witnesses and not traced:
            self._pending.clear()
            return False
        size, when = self._published
        idle = self.clock() - when >= self.idle_s
        # The whole log read once per idle period; the records this process appended taken as they were
        # written; what another writer appended read from the last record read (every second while idle).
        taken = None if idle else self._take_pending()
        if idle:
            self._pending.clear()  # the whole log is read: what was appended before is in it
        tree = taken if taken is not None else await self.tree(full=idle)
        if tree.size == size and not idle:
            return False
        if sink is not None and not self.witnesses and not traced:  # the directory alone: signed in its batch
            self._ready(sink, tree)
            sink.keep(tree.size, None, tree.root())
            self._published = (tree.size, self.clock())
            return True
        note = self._note(tree, tree.size)
        cosigned = await asyncio.gather(*(self._witness(w, tree, note) for w in self.witnesses)) \
            if self.witnesses else []  # at once, each over the one kept client
        lines = [line for line in cosigned if line]
        kept = with_lines(note, lines) if lines else note
        if sink is not None:
            self._ready(sink, tree)
            sink.keep(tree.size, kept, plain=not lines)  # on the loop: a journal line; the file in the batch
        if traced:
            telemetry.checkpoint(self.origin, tree.size, _b64(tree.root()), kept, self.clock())
        self._published = (tree.size, self.clock())
        return True

    async def sync_if_due(self) -> int:
        """The directory's batch when it is due, in a worker thread: the files of the checkpoints issued since
        the last one written, made durable, the mark moved. How many files it covered."""
        sink = self.sink()
        if sink is None or not sink.due(self.clock()):
            return 0
        batch, journaled = sink.take(self.clock())
        try:
            sizes = await asyncio.to_thread(sink.commit, batch)
        except BaseException:
            sink.give_back(batch)  # not durable: in the next batch (the mark did not move past them)
            raise
        sink.done(journaled)
        return len(sizes)

    def sync_now(self) -> int:
        """The batch now, whatever its interval (at shutdown): how many files it covered."""
        sink = self._sink
        if sink is None:
            return 0
        batch, journaled = sink.take(self.clock())
        try:
            sizes = sink.commit(batch)
        except OSError:
            log.exception("writing the checkpoint directory %s durably failed", sink.path)
            return 0
        sink.done(journaled)
        return len(sizes)

    async def _http_client(self) -> Any:
        """One HTTP client for the witnesses, kept (a client made per call builds a TLS context: ~20 ms of
        CPU on the loop for each checkpoint)."""
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=10)
        return self._http

    async def _witness(self, witness: Witness, tree: Tree, note: str) -> str:
        import httpx

        for _ in range(2):  # a 409 tells the size the witness holds: one more try from there
            old = min(witness.size, tree.size)
            proof = tree.consistency_proof(old, tree.size) if 0 < old < tree.size else []
            body = f"old {old}\n" + "".join(f"{_b64(h)}\n" for h in proof) + "\n" + note
            try:
                http = await self._http_client()
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
