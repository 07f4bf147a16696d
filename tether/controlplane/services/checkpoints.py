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

The directory commits in groups (``DirectorySink``): each checkpoint's file is written at once (readers see it)
and made durable in one batch every ``sync_s`` and at shutdown. A checkpoint is a function of the log alone
(the RFC 6962 root of its first N leaves, signed with deterministic Ed25519), so the store's log is its durable
source: on start, any file a machine crash left empty or torn is written again, and the checkpoint of the log
as it is covers every smaller one the crash took (docs/audit.md, "Durability of the directory sink").
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability.shared import publish_file, replace_file

from ..merkle import ProofError, Tree, record_leaf
from ..notes import Checkpoint, NoteError, Verifier, open_checkpoint, signed_checkpoint, with_lines
from ..store import Store

log = logging.getLogger("tether.checkpoints")
DEFAULT_ORIGIN = "tether/records"
DEFAULT_SYNC_S = 5.0
SYNCED = ".synced"  # the directory sink's mark: the newest size its last batch made durable
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
            self._sink = DirectorySink(self.directory)
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
        tree = await self.tree() if tree is None else tree
        return self._note(tree, tree.size)

    def _note(self, tree: Tree, size: int) -> str:
        return signed_checkpoint(Checkpoint(self.origin, size, tree.root(size)), self.origin, self.signing_key)

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
        note = self._note(tree, tree.size)
        lines = [line for w in self.witnesses if (line := await self._witness(w, tree, note))]
        kept = with_lines(note, lines) if lines else note
        if sink is not None:
            if size < 0:  # this process's first checkpoint: what a crash left of the last batch, repaired
                sink.recover(tree, lambda n: self._note(tree, n), self.verifier())
            sink.keep(tree.size, kept)  # on the loop: a small file, no fsync (see sync_s)
        if traced:
            telemetry.checkpoint(self.origin, tree.size, _b64(tree.root()), kept, self.clock())
        self._published = (tree.size, self.clock())
        return True

    async def sync_if_due(self) -> int:
        """Make the directory's new files durable when its batch is due (in a worker thread): how many."""
        sink = self.sink()
        if sink is None or not sink.due(self.clock()):
            return 0
        sizes = sink.take(self.clock())
        try:
            await asyncio.to_thread(sink.sync, sizes)
        except BaseException:
            sink.give_back(sizes)  # not durable: in the next batch (the mark did not move past them)
            raise
        return len(sizes)

    def sync_now(self) -> int:
        """Make every checkpoint file written so far durable, now (at shutdown): how many."""
        sink = self._sink
        if sink is None:
            return 0
        sizes = sink.take(self.clock())
        try:
            sink.sync(sizes)
        except OSError:
            log.exception("making the checkpoint directory %s durable failed", sink.path)
        return len(sizes)

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


@dataclass
class DirectorySink:
    """The append-only directory, committed in groups. ``keep`` writes a checkpoint's file at once (whole: a
    temporary file linked into place) without waiting for the disk; ``sync`` makes a batch of them durable
    (one ``syncfs`` of the directory's file system on Linux, else an fsync of each file and the directory)
    and then marks the newest size it covered in ``.synced``. ``recover``, at start, rewrites any file past
    that mark that a machine crash left empty or torn (a checkpoint is a function of the log: the same bytes)."""

    path: Path
    sync_s: float = DEFAULT_SYNC_S
    _unsynced: list[int] = field(default_factory=list)  # sizes written since the last batch
    _synced_at: float | None = None  # when the last batch was taken (None: none yet, the first is due at once)
    batches: int = 0  # batches made durable (the bench and the tests read it)

    def keep(self, size: int, note: str) -> None:
        keep_checkpoint(self.path, size, note, durable=False)
        self._unsynced.append(size)

    def due(self, now: float) -> bool:
        return bool(self._unsynced) and (self._synced_at is None or now - self._synced_at >= self.sync_s)

    def take(self, now: float) -> list[int]:
        """The sizes written since the last batch, handed to one ``sync`` (on the loop: ``keep`` goes on)."""
        sizes, self._unsynced, self._synced_at = self._unsynced, [], now
        return sizes

    def give_back(self, sizes: list[int]) -> None:
        self._unsynced[:0] = sizes

    def sync(self, sizes: list[int]) -> None:
        """The files of ``sizes`` durable, then ``.synced`` names the newest (itself durable with the next
        batch: a mark behind the files only makes ``recover`` look at a few more)."""
        if not sizes:
            return
        _make_durable(self.path, [f"checkpoint.{n}" for n in sizes])
        self.batches += 1
        tmp = self.path / f".synced.{os.getpid()}.{max(sizes)}"  # a batch at shutdown may overlap the last one
        tmp.write_text(f"{max(sizes)}\n")
        os.replace(tmp, self.path / SYNCED)

    def synced(self) -> int:
        """The newest size the last batch made durable (0: no mark, or one a crash tore: look at every file)."""
        try:
            return int((self.path / SYNCED).read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def recover(self, tree: Tree, note: Callable[[int], str], verifier: Verifier) -> list[int]:
        """At start: each ``checkpoint.N`` past the mark that is not a note signed with this log's key (a crash
        left it empty, or part of it) written again with checkpoint N of the log, and made durable with the
        next batch. A signed note that differs (another history: a restored backup, a rewrite) is evidence,
        never overwritten; one past the log's size is reported. The sizes written again."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            names = []
        sizes = sorted(int(x[11:]) for x in names if x.startswith("checkpoint.") and x[11:].isdigit())
        if not (self.path / SYNCED).exists():
            # No mark yet: a directory kept before batches (each file was fsynced) or a new one. The mark is
            # made, durably, before the first file that is not: from here on a file past it may be incomplete.
            self.path.mkdir(parents=True, exist_ok=True)
            replace_file(self.path / SYNCED, f"{sizes[-1] if sizes else 0}\n".encode())
        mark, fixed = self.synced(), []
        for n in sizes:
            if n <= mark:
                continue
            self._unsynced.append(n)  # written after the last batch: durable with the next one
            target = self.path / f"checkpoint.{n}"
            try:
                open_checkpoint(target.read_text(), verifier)
                continue  # whole (it may be of another history: then it is kept, as evidence)
            except (NoteError, UnicodeDecodeError, ValueError):
                pass
            if n > tree.size:
                log.error("checkpoint directory %s: %s is unreadable and past the log's %d records: left as it is",
                          self.path, target.name, tree.size)
                continue
            replace_file(target, note(n).encode())
            fixed.append(n)
        if fixed:
            log.warning("checkpoint directory %s: %d checkpoint files a crash left incomplete written again "
                        "from the log (sizes %s)", self.path, len(fixed), ", ".join(map(str, fixed[:10])))
        return fixed


def keep_checkpoint(directory: Path, size: int, note: str, *, durable: bool = True) -> None:
    """The directory sink: ``checkpoint.SIZE``, written once and never rewritten (append-only: a WORM mount),
    whole (a temporary file linked into place), durably unless ``durable`` is false (``DirectorySink``:
    the batch makes it durable), and ``latest``, a second name of that same file (a hard link), replaced
    atomically by a rename: no second file to create. A note of a size already kept that differs from the
    kept one (the same checkpoint with other cosignatures, from a later publication) is kept as ``latest``
    itself, a file of its own."""
    name, data = f"checkpoint.{size}", note.encode()
    target = f"{directory}/{name}"
    try:
        created = publish_file(target, data, 0o644) if durable else _publish_lazily(str(directory), name, data)
    except FileNotFoundError:  # no directory yet
        directory.mkdir(parents=True, exist_ok=True)
        created = publish_file(target, data, 0o644) if durable else _publish_lazily(str(directory), name, data)
    if created is None:
        return  # written, and named latest already
    if not created and Path(target).read_bytes() != data:
        replace_file(directory / "latest", data)  # a size kept before, with another note: the file stays
        return
    link = f"{directory}/.latest.{os.getpid()}"
    try:
        os.link(target, link)
    except FileExistsError:
        os.unlink(link)
        os.link(target, link)
    os.replace(link, f"{directory}/latest")


def _publish_lazily(d: str, name: str, data: bytes) -> bool | None:
    """``name`` created holding ``data`` whole, not yet durable, and ``latest`` made that same file: a
    temporary file (this process's, by name) linked as ``name``, then renamed onto ``latest`` (one file
    created, two names given: the least a checkpoint can cost the disk short of its data). None when both
    were done; False when ``name`` existed (it stands untouched, and ``latest`` too)."""
    tmp = f"{d}/.{name}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fchmod(fd, 0o644)  # whatever the umask: readers (an auditor's copy job) read it
        os.write(fd, data)
    finally:
        os.close(fd)
    try:
        os.link(tmp, f"{d}/{name}")
    except FileExistsError:
        os.unlink(tmp)
        return False
    _swap_in(tmp, f"{d}/latest")
    return None


def _swap_in(tmp: str, path: str) -> None:
    """``tmp`` renamed onto ``path``, atomically. On Linux by exchanging the two names (``renameat2`` with
    ``RENAME_EXCHANGE``) and removing the old one: ext4 starts writing a file's data out when a rename
    replaces another file (``auto_da_alloc``), about 35 us of CPU a checkpoint here, which the batch does
    anyway. Where the exchange is not offered (another system, no ``path`` yet), a plain rename."""
    if _renameat2 is not None and _renameat2(_AT_FDCWD, tmp.encode(), _AT_FDCWD, path.encode(), _EXCHANGE) == 0:
        os.unlink(tmp)  # now the old ``path``
        return
    os.replace(tmp, path)


def _make_durable(directory: Path, names: list[str]) -> None:
    """These files of ``directory``, and its entries, on disk: one ``syncfs`` of its file system on Linux
    (one journal commit however many files; it also flushes what else is waiting on that file system),
    elsewhere an fsync of each file, then of the directory."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        if _syncfs is not None:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs of {directory}: {os.strerror(err)}")
            return
        for name in names:
            try:
                f = os.open(directory / name, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(f)
            finally:
                os.close(f)
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn  # type: ignore[no-any-return]


_syncfs = _load_syncfs()
_AT_FDCWD, _EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _load_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_renameat2 = _load_renameat2()


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
