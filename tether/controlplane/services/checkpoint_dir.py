"""The checkpoint directory (``--checkpoint-dir``): an append-only directory of ``checkpoint.SIZE`` files and
``latest``, a second name of the newest, committed in groups.

A checkpoint costs the event loop one ``write(2)`` of its size to ``.issued``, a journal this process keeps
open (``DirectorySink.keep``); its file is written with the others issued since, in a worker thread, in a
batch every ``sync_s`` and at shutdown, and made durable in that same batch (one ``syncfs``), after which
``.synced`` names the newest size it covered and the journal is emptied. A checkpoint the control plane serves
(``GET /v1/records/checkpoint``) is written before it is served (``flush``): ``latest`` never names one older.

A checkpoint is a function of the log alone (the RFC 6962 root of its first N leaves, signed with deterministic
Ed25519), so the store's log is the durable source of every file: on start (``recover``), each size past the
mark that the journal lists or the directory holds, whose file a kill never wrote or a machine crash left
empty or torn, is written from the log (docs/audit.md, "Durability of the directory sink")."""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tether.capability.shared import publish_file, replace_file

from ..merkle import Tree
from ..notes import NoteError, Verifier, open_checkpoint

log = logging.getLogger("tether.checkpoints")
DEFAULT_SYNC_S = 5.0
SYNCED = ".synced"  # the newest size the last batch made durable
ISSUED = ".issued"  # the journal: a line per checkpoint issued since the last batch ("SIZE" or "SIZE NOTE-B64")
Issued = tuple[int, str | None, bytes]  # (size, its note, or None: signed in the batch, its root)
Batch = tuple[list[Issued], list[int]]  # (checkpoints whose files are to be written, files written)


@dataclass
class DirectorySink:
    """The directory, committed in groups. On the loop: ``keep`` (a journal line), ``take`` and ``give_back``;
    in a worker thread: ``commit`` (the batch's files written, ``latest`` moved, one ``syncfs``, the mark) and
    ``write`` (files only: what ``flush`` asks before a checkpoint is served). ``recover`` runs once, before
    the first ``keep``."""

    path: Path
    sync_s: float = DEFAULT_SYNC_S
    sign: Callable[[int, bytes], str] | None = None  # (size, root) -> the log's note, for a checkpoint kept unsigned
    recovered: bool = False
    batches: int = 0  # batches made durable (the bench and the tests read it)
    _queued: list[Issued] = field(default_factory=list)  # issued, journaled, no file yet
    _unsynced: list[int] = field(default_factory=list)  # files written since the last batch
    _synced_at: float | None = None  # when the last batch was taken (None: none yet, the first is due at once)
    _journal: int | None = None  # the open ``.issued``
    _mark: int | None = None  # the open ``.synced``
    _journaled: int = 0  # lines journaled by this process (a batch empties the journal only if none came since)
    _latest: tuple[int, bytes] = (-1, b"")  # what ``latest`` holds (written under ``_lock``)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- on the event loop ---------------------------------------------------------------------------------
    def keep(self, size: int, note: str | None, root: bytes = b"", *, plain: bool = True) -> None:
        """Checkpoint ``size`` issued: its journal line (the note itself only when it is not the log's own,
        ``plain``: a witness's cosignatures added), its file left to the batch. ``note`` None: nobody has seen
        it yet, the batch signs it (``sign``) from ``root``."""
        line = f"{size}\n" if plain or note is None else f"{size} {base64.b64encode(note.encode()).decode()}\n"
        if self._journal is None:
            self._journal = os.open(self.path / ISSUED, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._journal, line.encode())
        self._journaled += 1
        self._queued.append((size, note, root))

    def newest(self) -> int:
        """The newest size issued to this directory (-1: none yet)."""
        return max(self._queued[-1][0] if self._queued else -1, self._latest[0])

    def due(self, now: float) -> bool:
        pending = bool(self._queued or self._unsynced)
        return pending and (self._synced_at is None or now - self._synced_at >= self.sync_s)

    def take(self, now: float) -> tuple[Batch, int]:
        """What the next batch covers (and the journal's count then, for ``done``)."""
        batch = (self._queued, self._unsynced)
        self._queued, self._unsynced, self._synced_at = [], [], now
        return batch, self._journaled

    def take_queued(self) -> list[Issued]:
        """The checkpoints whose files are still to be written, for ``write`` now (``flush``)."""
        notes, self._queued = self._queued, []
        return notes

    def give_back(self, batch: Batch) -> None:
        """A batch that failed: all of it in the next one (writing a file again is a no-op)."""
        self._queued[:0], self._unsynced[:0] = batch

    def done(self, journaled: int) -> None:
        """A batch committed: the journal emptied when nothing was issued since it was taken."""
        if self._journal is not None and journaled == self._journaled:
            os.ftruncate(self._journal, 0)

    def written(self, sizes: list[int]) -> None:
        """Files ``write`` made outside a batch: durable with the next one."""
        self._unsynced.extend(sizes)

    # -- in a worker thread (or at shutdown) ------------------------------------------------------------------
    def commit(self, batch: Batch) -> list[int]:
        """The batch's files written, then made durable, then the mark: the sizes it covered."""
        notes, sizes = batch
        sizes = sizes + self.write(notes)
        self.sync(sizes)
        return sizes

    def write(self, notes: list[Issued]) -> list[int]:
        """Each checkpoint's file created whole (an existing one stands: append-only), and ``latest`` moved to
        the newest if it is newer than what it names (never back). Not durable: the batch is."""
        if not notes:
            return []
        with self._lock:
            newest: tuple[int, bytes, bool] | None = None
            for size, note, root in notes:
                if note is None:
                    assert self.sign is not None, "a checkpoint kept unsigned with no signer"
                    note = self.sign(size, root)
                data = note.encode()
                created = _create(str(self.path), f"checkpoint.{size}", data)
                if newest is None or size >= newest[0]:
                    newest = (size, data, created or _read(self.path / f"checkpoint.{size}") == data)
            assert newest is not None
            size, data, same = newest
            if (size, data) != self._latest and size >= self._latest[0]:
                if same:  # ``latest`` a second name of that file
                    _link_latest(str(self.path), f"checkpoint.{size}")
                else:  # a size kept before with another note (other cosignatures): a file of its own
                    replace_file(self.path / "latest", data)
                self._latest = (size, data)
        return [n for n, _, _ in notes]

    def sync(self, sizes: list[int]) -> None:
        """The files of ``sizes`` durable, then ``.synced`` names the newest (itself durable with the next
        batch: a mark behind the files only makes ``recover`` look at a few more)."""
        if not sizes:
            return
        _make_durable(self.path, [f"checkpoint.{n}" for n in sizes])
        self.batches += 1
        with self._lock:  # written in place (a rename over it would start ext4 writing it out at once)
            if self._mark is None:
                self._mark = os.open(self.path / SYNCED, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._mark, f"{max(sizes):>20}\n".encode(), 0)  # one width: no old digits left behind

    # -- at start ------------------------------------------------------------------------------------------
    def synced(self) -> int:
        """The newest size the last batch made durable (0: no mark, or one a crash tore: look at every file)."""
        try:
            return int((self.path / SYNCED).read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def recover(self, tree: Tree, note: Callable[[int], str], verifier: Verifier) -> list[int]:
        """At start: each size past the mark that the journal lists (issued, its file perhaps never written: a
        kill) or the directory holds, whose file is missing or not a note signed with this log's key (a
        machine crash left it empty, or part of it), written from the log (the journal's note when it is
        that checkpoint with cosignatures), durably; all of them in the next batch, and ``latest`` moved to
        the newest. A signed note that differs (another history: a restored backup, a rewrite) is evidence,
        never overwritten; a size past the log's is reported. The sizes written."""
        self.recovered = True
        self.path.mkdir(parents=True, exist_ok=True)
        names = os.listdir(self.path)
        on_disk = {int(x[11:]) for x in names if x.startswith("checkpoint.") and x[11:].isdigit()}
        if not (self.path / SYNCED).exists():
            # No mark yet: a directory kept before batches (each file was fsynced) or a new one. The mark is
            # made, durably, before the first file that is not: from here on a file past it may be incomplete.
            replace_file(self.path / SYNCED, f"{max(on_disk, default=0)}\n".encode())
        mark, journal = self.synced(), _read_journal(self.path / ISSUED)
        self._journal = os.open(self.path / ISSUED, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        latest = _read(self.path / "latest")
        self._latest = (_size_of(latest), latest)
        torn, missing, ours = [], [], []  # ours: this log's checkpoints past the mark, on disk now
        for n in sorted({*on_disk, *journal}):
            if n <= mark:
                continue
            target = self.path / f"checkpoint.{n}"
            if n in on_disk:
                try:
                    text = target.read_text()
                    open_checkpoint(text, verifier)
                    self._unsynced.append(n)
                    if n <= tree.size and _same_checkpoint(text, note(n), verifier):
                        ours.append(n)
                    continue  # whole (it may be of another history: then it is kept, as evidence)
                except (NoteError, UnicodeDecodeError, ValueError, OSError):
                    pass
            if n > tree.size:
                log.error("checkpoint directory %s: checkpoint.%d is unreadable or missing and past the log's %d "
                          "records: left as it is", self.path, n, tree.size)
                continue
            own, kept = note(n), journal.get(n)
            data = (kept if kept and _same_checkpoint(kept, own, verifier) else own).encode()
            replace_file(target, data)
            (torn if n in on_disk else missing).append(n)
            self._unsynced.append(n)
            ours.append(n)
        newest = max(ours, default=-1)
        if newest > self._latest[0]:
            _link_latest(str(self.path), f"checkpoint.{newest}")
            self._latest = (newest, _read(self.path / f"checkpoint.{newest}"))
        if torn:
            log.warning("checkpoint directory %s: %d checkpoint files a crash left incomplete written again "
                        "from the log (sizes %s)", self.path, len(torn), ", ".join(map(str, torn[:10])))
        if missing:
            log.warning("checkpoint directory %s: %d checkpoints issued before the last stop, their files never "
                        "written: written from the log (sizes %s)", self.path, len(missing),
                        ", ".join(map(str, missing[:10])))
        return sorted(torn + missing)


def _read_journal(path: Path) -> dict[int, str]:
    """``.issued``: size -> the note it names ("" for the log's own); a line a crash cut short is skipped."""
    out: dict[int, str] = {}
    try:
        text = path.read_bytes().decode("ascii", "replace")
    except FileNotFoundError:
        return out
    for line in text.split("\n")[:-1]:  # the last piece has no newline: cut short, or empty
        size, _, note = line.partition(" ")
        if not size.isdigit():
            continue
        try:
            out[int(size)] = base64.b64decode(note, validate=True).decode() if note else out.get(int(size), "")
        except ValueError:
            continue
    return out


def _same_checkpoint(kept: str, ours: str, verifier: Verifier) -> bool:
    """``kept`` is the checkpoint ``ours`` is, signed by this log's key (cosignatures may follow)."""
    try:
        return kept.startswith(ours) and open_checkpoint(kept, verifier) is not None
    except (NoteError, ValueError):
        return False


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _size_of(note: bytes) -> int:
    lines = note.split(b"\n")
    return int(lines[1]) if len(lines) > 2 and lines[1].isdigit() else -1


def keep_checkpoint(directory: Path, size: int, note: str) -> None:
    """One checkpoint kept at once and durably, as the sink did before its batches (the bench's comparison):
    ``checkpoint.SIZE`` written once, whole and fsynced, and ``latest`` a second name of it."""
    if publish_file(f"{directory}/checkpoint.{size}", note.encode(), 0o644):
        _link_latest(str(directory), f"checkpoint.{size}")


def _create(d: str, name: str, data: bytes) -> bool:
    """``name`` created holding ``data``, whole (a reader finds all of it or no file), not yet durable: an
    unnamed file (``O_TMPFILE``) linked into place, else a temporary file linked and removed. False when
    ``name`` existed (it stands untouched)."""
    target = f"{d}/{name}"
    if _linkat is not None:
        try:
            fd = os.open(d, os.O_TMPFILE | os.O_WRONLY, 0o644)
        except OSError:  # a file system without unnamed files
            pass
        else:
            try:
                os.fchmod(fd, 0o644)  # whatever the umask: readers (an auditor's copy job) read it
                _write_all(fd, data)
                if _linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, target.encode(), _FOLLOW) == 0:
                    return True
                err = ctypes.get_errno()
                if err == 17:  # EEXIST
                    return False
                if err not in (2, 18):  # ENOENT, EXDEV: no /proc here; the other way
                    raise OSError(err, f"linking {target}: {os.strerror(err)}")
            finally:
                os.close(fd)
    tmp = f"{d}/.{name}.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        _write_all(fd, data)
    finally:
        os.close(fd)
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _link_latest(d: str, name: str) -> None:
    """``latest`` made a second name of ``name`` (a hard link), swapped in atomically."""
    link = f"{d}/.latest.{os.getpid()}"
    try:
        os.link(f"{d}/{name}", link)
    except FileExistsError:
        os.unlink(link)
        os.link(f"{d}/{name}", link)
    _swap_in(link, f"{d}/latest")


def _swap_in(tmp: str, path: str) -> None:
    """``tmp`` renamed onto ``path``, atomically. On Linux by exchanging the two names (``renameat2`` with
    ``RENAME_EXCHANGE``) and removing the old one: ext4 starts writing a file's data out when a rename
    replaces another file (``auto_da_alloc``), which the batch does anyway. Where the exchange is not offered
    (another system, no ``path`` yet), a plain rename."""
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


def _libc(name: str, args: list[type], res: type = ctypes.c_int) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = args, res
    return fn  # type: ignore[no-any-return]


_AT_FDCWD, _EXCHANGE, _FOLLOW = -100, 2, 0x400  # <fcntl.h>, <linux/fs.h>: AT_SYMLINK_FOLLOW
_syncfs = _libc("syncfs", [ctypes.c_int])
_renameat2 = _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
_linkat = _libc("linkat", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int])
