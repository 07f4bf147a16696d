"""The directory sink commits in groups (``--checkpoint-sync``): a checkpoint issued is a line in ``.issued``; its
file is written, with the others issued since, and made durable in one batch at most every S seconds and at
shutdown; ``.synced`` names the newest size the last batch covered; a checkpoint served by ``GET
/v1/records/checkpoint`` is in the directory before it is served. A control plane killed before the batch
never wrote its last files: the next start writes every one the journal lists from the log, byte for byte as
the batch would have; what a machine crash would leave on disk (the files past the mark empty) is written again
too. A test cannot lose a page cache: the crash's damage is made by hand, and the batch is seen by its mark,
written only after the ``syncfs`` returned."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from tether.capability import keys
from tether.controlplane.services.checkpoints import CheckpointService, DirectorySink
from tether.controlplane.store import open_store_url
from tether.controlplane.termination import seal

from .harness import PYTHON, prepare_controlplane, wait_until
from .test_keys import _terminate_one, tether

ORIGIN = "tether.test/records"


def size_of(path: Path) -> int:
    """The size a checkpoint file (or ``latest``) commits to; 0 while it is absent or incomplete."""
    try:
        lines = path.read_text().split("\n")
    except OSError:
        return 0
    return int(lines[1]) if len(lines) > 2 and lines[1].isdigit() else 0


def mark(directory: Path) -> int:
    try:
        return int((directory / ".synced").read_text().strip())
    except (OSError, ValueError):
        return 0


def issued(directory: Path) -> set[int]:
    """The sizes the journal lists: checkpoints issued since the last batch."""
    try:
        return {int(line.split(" ")[0]) for line in (directory / ".issued").read_text().splitlines()}
    except (OSError, ValueError):
        return set()


def files(directory: Path) -> list[int]:
    return sorted(int(p.name[11:]) for p in directory.glob("checkpoint.*"))


def served(cp) -> str:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(cp.url + "/v1/records/checkpoint", timeout=30) as resp:
        return resp.read().decode()


def verifies(cp, tmp_path: Path, path: Path) -> None:  # type: ignore[no-untyped-def]
    ok = tether("records", "verify", "--checkpoint", str(path), cwd=tmp_path, env=cp.env())
    assert ok.returncode == 0, f"{path.name}: {ok.stdout}{ok.stderr}"


def test_a_killed_control_plane_s_unwritten_checkpoints_and_a_crash_s_empty_files_come_back(
        tmp_path: Path, store: str) -> None:
    directory = tmp_path / "checkpoints"
    latest = directory / "latest"
    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(directory), "--checkpoint-sync", "3600")
    try:
        cp.start()
        wait_until(lambda: mark(directory) == 0 and files(directory) == [0], 60, what="the start's batch")
        for n, agent in enumerate(("a", "b", "c"), start=1):
            _terminate_one(cp, tmp_path, agent)
            wait_until(lambda n=n: n in issued(directory), 60, what=f"checkpoint {n} issued")
        assert files(directory) == [0] and size_of(latest) == 0  # issued, their files the batch's (in an hour)
        cp.stop(signal.SIGKILL)  # between the records' checkpoints and their files
        assert files(directory) == [0]

        cp.start()  # its first checkpoint is of 3 records: 1 and 2 come only from the journal
        wait_until(lambda: size_of(latest) == 3, 60, what="checkpoint 3 after the restart")
        wait_until(lambda: mark(directory) == 3, 60, what="the restart's first batch covering 1 to 3")
        assert "never written: written from the log (sizes 1, 2, 3)" in (tmp_path / "controlplane.log").read_text()
        assert files(directory) == [0, 1, 2, 3]
        wait_until(lambda: issued(directory) == set(), 30, what="the journal emptied by the batch")
        kept = {n: (directory / f"checkpoint.{n}").read_bytes() for n in (1, 2, 3)}
        for n in (1, 2, 3):
            assert size_of(directory / f"checkpoint.{n}") == n
            verifies(cp, tmp_path, directory / f"checkpoint.{n}")
        assert served(cp) == kept[3].decode()  # the log's own checkpoint 3, as the batch would have written it
        cp.stop(signal.SIGKILL)

        # What a machine crash before the batch leaves on ext4: the files past the mark linked but empty
        # (their data never flushed), the mark where the last batch left it.
        (directory / ".synced").write_text("1\n")
        for n in (2, 3):
            (directory / f"checkpoint.{n}").write_bytes(b"")
        cp.start()
        wait_until(lambda: all((directory / f"checkpoint.{n}").read_bytes() == kept[n] for n in (2, 3)), 60,
                   what="the empty checkpoint files written again from the log")
        assert (directory / "checkpoint.1").read_bytes() == kept[1]
        wait_until(lambda: mark(directory) == 3, 60, what="the rewritten files in a batch")
        assert "written again from the log" in (tmp_path / "controlplane.log").read_text()
        for n in (2, 3):
            verifies(cp, tmp_path, directory / f"checkpoint.{n}")
    finally:
        cp.stop()


def test_the_batch_runs_at_its_interval_and_at_shutdown(tmp_path: Path, store: str) -> None:
    directory = tmp_path / "checkpoints"
    latest = directory / "latest"
    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(directory), "--checkpoint-sync", "3600")
    try:
        cp.start()
        _terminate_one(cp, tmp_path, "a")
        wait_until(lambda: 1 in issued(directory), 60, what="checkpoint 1 issued")
        _terminate_one(cp, tmp_path, "b")
        wait_until(lambda: 2 in issued(directory), 60, what="checkpoint 2 issued")
        assert files(directory) == [0] and mark(directory) == 0  # 1 and 2 issued, not batched yet

        # A checkpoint served is in the directory first: latest never names an older one than a reader got.
        note = served(cp)
        assert note.split("\n")[1] == "2" and latest.read_text() == note
        assert files(directory) == [0, 1, 2] and mark(directory) == 0  # written, not yet made durable
        _terminate_one(cp, tmp_path, "c")
        wait_until(lambda: 3 in issued(directory), 60, what="checkpoint 3 issued")
        assert files(directory) == [0, 1, 2] and latest.read_text() == note
        cp.stop()  # SIGTERM: the shutdown makes the last batch
        assert files(directory) == [0, 1, 2, 3] and mark(directory) == 3 and size_of(latest) == 3
        assert (directory / "checkpoint.2").read_text() == note
        assert issued(directory) == set()  # the batch covered the journal: emptied
        assert latest.stat().st_ino == (directory / "checkpoint.3").stat().st_ino

        cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(directory), "--checkpoint-sync", "0.2")
        cp.start()
        _terminate_one(cp, tmp_path, "d")
        wait_until(lambda: size_of(latest) == 4 and mark(directory) == 4, 60, what="checkpoint 4 batched by 0.2 s")
        verifies(cp, tmp_path, latest)
        for n in (1, 2, 3, 4):
            verifies(cp, tmp_path, directory / f"checkpoint.{n}")
    finally:
        cp.stop()


def test_a_bad_sync_interval_is_refused(tmp_path: Path) -> None:
    cp = prepare_controlplane(tmp_path, 1, 2, 3)
    done = subprocess.run(  # it exits before it serves (a generous timeout: a start is slow on loaded cores)
        [PYTHON, "-m", "tether", "controlplane", "serve", "--listen", f"127.0.0.1:{cp.port}", "--store",
         f"sqlite:///{tmp_path / 'tether.db'}", "--catalog", str(cp.catalog_path), "--signing-key",
         str(cp.signing_key_path), "--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-sync", "-1"],
        capture_output=True, text=True, timeout=180, env=cp.env())
    assert done.returncode != 0
    assert "--checkpoint-sync -1.0: seconds, 0 or more" in done.stdout + done.stderr


def test_checkpoints_follow_this_process_s_records_and_another_writer_s(tmp_path: Path, store: str) -> None:
    """Records this process appends are taken into the tree as they are written; another writer's (a second
    store client on the same log) are read from the store. Each published checkpoint is the log's own."""
    key = keys.generate()

    async def run() -> None:
        ours, theirs = open_store_url(store), open_store_url(store)
        await ours.open()
        await theirs.open()
        try:
            service = CheckpointService(ours, key, origin=ORIGIN, directory=tmp_path / "d", sync_s=3600)
            head, expected = "", {}
            for i, writer in enumerate((ours, ours, theirs, ours, ours, theirs, theirs, ours)):
                sealed = seal({"record_id": f"rec-{i}", "termination_id": f"t-{i}", "calls": [], "prev_hash": head,
                               "agents_unaccounted": []}, key)
                assert await writer.append_record(sealed)
                head = sealed["hash"]
                assert await service.publish_if_due()
                assert i + 1 in issued(tmp_path / "d")
                expected[i + 1] = await CheckpointService(theirs, key, origin=ORIGIN).checkpoint()
                if i == 0:
                    assert await service.sync_if_due() == 1  # the first batch: due at once
                    assert mark(tmp_path / "d") == 1 and issued(tmp_path / "d") == set()
                else:
                    assert await service.sync_if_due() == 0  # the next: in an hour
                    assert files(tmp_path / "d") == [1]  # issued, written by that batch
            assert isinstance(service.sink(), DirectorySink)
            assert service.sync_now() == 7 and mark(tmp_path / "d") == 8 and files(tmp_path / "d") == list(expected)
            for n, note in expected.items():
                assert (tmp_path / "d" / f"checkpoint.{n}").read_text() == note
        finally:
            await ours.close()
            await theirs.close()

    asyncio.run(run())


def test_the_directory_sink_journals_batches_and_repairs() -> None:
    """``DirectorySink``: a checkpoint kept is a journal line; the batch writes its file (signing it when it was
    kept unsigned), moves ``latest`` (never back), makes them durable and empties the journal. At a start, a
    size past the mark whose file was never written (the journal lists it) or is not a signed note is written
    from the log (the journal's own note when it is that checkpoint cosigned); a signed note of another history
    is kept (evidence); a journal line a crash cut short names nothing."""
    from tether.controlplane.merkle import Tree, record_leaf
    from tether.controlplane.notes import Checkpoint, Verifier, signed_checkpoint, with_lines

    key = keys.generate()
    tree = Tree([record_leaf(f"sha256:{i:064x}") for i in range(8)])
    other = Tree([record_leaf(f"sha256:{i + 9:064x}") for i in range(8)])
    verifier = Verifier(ORIGIN, key.public_key())

    def note(t: Tree, n: int) -> str:
        return signed_checkpoint(Checkpoint(ORIGIN, n, t.root(n)), ORIGIN, key)

    def sink_at(path: Path) -> DirectorySink:
        return DirectorySink(path, sign=lambda n, root: signed_checkpoint(Checkpoint(ORIGIN, n, root), ORIGIN, key))

    with tempfile.TemporaryDirectory() as d:
        sink = sink_at(Path(d) / "c")
        assert sink.recover(tree, lambda n: note(tree, n), verifier) == []
        assert mark(sink.path) == 0  # the mark made before any file that is not durable
        sink.keep(1, note(tree, 1))
        sink.keep(2, None, tree.root(2))  # unsigned: the batch signs it
        sink.keep(3, note(tree, 3))
        assert issued(sink.path) == {1, 2, 3} and files(sink.path) == [] and sink.newest() == 3
        assert sink.due(0.0)
        batch, journaled = sink.take(0.0)
        assert sink.commit(batch) == [1, 2, 3]
        sink.done(journaled)
        assert sink.batches == 1 and mark(sink.path) == 3 and not sink.due(1.0) and issued(sink.path) == set()
        for n in (1, 2, 3):
            assert (sink.path / f"checkpoint.{n}").read_text() == note(tree, n)
        latest = sink.path / "latest"  # the newest file under a second name, and nothing else left behind
        assert latest.read_text() == note(tree, 3)
        assert latest.stat().st_ino == (sink.path / "checkpoint.3").stat().st_ino
        assert sorted(p.name for p in sink.path.iterdir()) == [".issued", ".synced", "checkpoint.1", "checkpoint.2",
                                                               "checkpoint.3", "latest"]
        assert sink.write([(1, note(tree, 1), b"")]) == [1] and latest.read_text() == note(tree, 3)  # not back

        cosigned = with_lines(note(tree, 4), ["\u2014 witness.test AAAAAAAA\n"])
        sink.keep(4, cosigned, plain=False)
        sink.keep(5, note(other, 5))  # a history that is not this tree's
        sink.keep(6, None, tree.root(6))
        assert not sink.due(1.0) and sink.due(5.0)
        sink.write(sink.take_queued()[1:])  # killed with 4 never written, 5 and 6 written
        (sink.path / "checkpoint.6").write_bytes(b"")  # a crash: 6 (and latest, its second name) empty
        (sink.path / "checkpoint.3").write_bytes(b"")  # within the mark: durable before, not looked at
        with open(sink.path / ".issued", "a") as journal:
            journal.write("7")  # a line the crash cut short
        again = sink_at(sink.path)
        assert again.recover(tree, lambda n: note(tree, n), verifier) == [4, 6]
        assert (sink.path / "checkpoint.4").read_text() == cosigned
        assert (sink.path / "checkpoint.5").read_text() == note(other, 5)
        assert (sink.path / "checkpoint.6").read_text() == note(tree, 6) == latest.read_text()
        assert (sink.path / "checkpoint.3").read_bytes() == b"" and files(sink.path) == [1, 2, 3, 4, 5, 6]
        assert again.take(0.0) == (([], [4, 5, 6]), 0)
