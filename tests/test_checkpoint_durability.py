"""The directory sink commits in groups (``--checkpoint-sync``): each checkpoint's file is written at once, and
made durable in one batch at most every S seconds and at shutdown; ``.synced`` names the newest size the last
batch covered. A killed control plane loses nothing (the kernel holds what it wrote); what a machine crash
would leave on disk (the files past the mark empty: written, never flushed) is written again from the log at
the next start, byte for byte. A test cannot lose a page cache: the crash's damage is made by hand, and the
batch is seen by its mark, written only after the ``syncfs`` returned."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability import keys
from tether.controlplane.services.checkpoints import CheckpointService, DirectorySink
from tether.controlplane.store import open_store_url
from tether.controlplane.termination import seal

from .harness import PYTHON, RedisServer, prepare_controlplane, wait_until
from .test_keys import _terminate_one, tether

ORIGIN = "tether.test/records"


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tether.db'}"
        return
    redis = RedisServer(tmp_path / "redis").start()
    try:
        yield redis.url()
    finally:
        redis.stop()


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


def verifies(cp, tmp_path: Path, path: Path) -> None:  # type: ignore[no-untyped-def]
    ok = tether("records", "verify", "--checkpoint", str(path), cwd=tmp_path, env=cp.env())
    assert ok.returncode == 0, f"{path.name}: {ok.stdout}{ok.stderr}"


def test_a_killed_control_plane_leaves_every_checkpoint_and_a_crash_s_empty_files_come_back(
        tmp_path: Path, store: str) -> None:
    directory = tmp_path / "checkpoints"
    latest = directory / "latest"
    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(directory), "--checkpoint-sync", "3600")
    try:
        cp.start()
        for n, agent in enumerate(("a", "b"), start=1):
            _terminate_one(cp, tmp_path, agent)
            wait_until(lambda n=n: size_of(latest) == n, 60, what=f"checkpoint {n}")
        assert mark(directory) == 0  # the first batch at start (checkpoint 0), the next not for an hour
        _terminate_one(cp, tmp_path, "c")
        cp.stop(signal.SIGKILL)  # right after the record: its checkpoint may not have gone out
        cp.start()
        wait_until(lambda: size_of(latest) == 3, 60, what="checkpoint 3 after the restart")
        wait_until(lambda: mark(directory) == 3, 60, what="the restart's first batch covering 2 and 3")
        kept = {n: (directory / f"checkpoint.{n}").read_bytes() for n in (1, 2, 3)}
        for n in (1, 2, 3):
            assert size_of(directory / f"checkpoint.{n}") == n
            verifies(cp, tmp_path, directory / f"checkpoint.{n}")
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
        wait_until(lambda: size_of(latest) == 1, 60, what="checkpoint 1")
        _terminate_one(cp, tmp_path, "b")
        wait_until(lambda: size_of(latest) == 2, 60, what="checkpoint 2")
        assert (directory / ".synced").exists() and mark(directory) == 0  # 1 and 2 readable, not batched yet
        cp.stop()  # SIGTERM: the shutdown makes the last batch
        assert mark(directory) == 2

        cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(directory), "--checkpoint-sync", "0.2")
        cp.start()
        _terminate_one(cp, tmp_path, "c")
        wait_until(lambda: size_of(latest) == 3 and mark(directory) == 3, 60, what="checkpoint 3 batched by 0.2 s")
        verifies(cp, tmp_path, latest)
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
            head = ""
            for i, writer in enumerate((ours, ours, theirs, ours, ours, theirs, theirs, ours)):
                sealed = seal({"record_id": f"rec-{i}", "termination_id": f"t-{i}", "calls": [], "prev_hash": head,
                               "agents_unaccounted": []}, key)
                assert await writer.append_record(sealed)
                head = sealed["hash"]
                assert await service.publish_if_due()
                fresh = CheckpointService(theirs, key, origin=ORIGIN)
                assert (tmp_path / "d" / f"checkpoint.{i + 1}").read_text() == await fresh.checkpoint()
                if i == 0:
                    assert await service.sync_if_due() == 1  # the first batch: due at once
                    assert mark(tmp_path / "d") == 1
                else:
                    assert await service.sync_if_due() == 0  # the next: in an hour
            assert isinstance(service.sink(), DirectorySink)
            assert service.sync_now() == 7 and mark(tmp_path / "d") == 8
        finally:
            await ours.close()
            await theirs.close()

    asyncio.run(run())


def test_the_directory_sink_batches_and_repairs_only_incomplete_files() -> None:
    """``DirectorySink``: files written at once, durable per batch; at a start, a file past the mark that is not
    a signed note is written again, a signed note of another history is kept (evidence)."""
    from tether.controlplane.merkle import Tree, record_leaf
    from tether.controlplane.notes import Checkpoint, Verifier, signed_checkpoint

    key = keys.generate()
    tree = Tree([record_leaf(f"sha256:{i:064x}") for i in range(5)])
    other = Tree([record_leaf(f"sha256:{i + 9:064x}") for i in range(5)])

    def note(t: Tree, n: int) -> str:
        return signed_checkpoint(Checkpoint(ORIGIN, n, t.root(n)), ORIGIN, key)

    with tempfile.TemporaryDirectory() as d:
        sink = DirectorySink(Path(d) / "c")
        assert sink.recover(tree, lambda n: note(tree, n), Verifier(ORIGIN, key.public_key())) == []
        assert mark(sink.path) == 0  # the mark made before any file that is not durable
        for n in (1, 2, 3):
            sink.keep(n, note(tree, n))
        assert sink.due(0.0)
        sink.sync(sink.take(0.0))
        assert sink.batches == 1 and mark(sink.path) == 3 and not sink.due(1.0)
        latest = sink.path / "latest"  # the newest file under a second name, and nothing else left behind
        assert latest.read_text() == note(tree, 3)
        assert latest.stat().st_ino == (sink.path / "checkpoint.3").stat().st_ino
        assert sorted(p.name for p in sink.path.iterdir()) == [".synced", "checkpoint.1", "checkpoint.2",
                                                               "checkpoint.3", "latest"]
        sink.keep(4, note(tree, 4))
        sink.keep(5, note(other, 5))  # a history that is not this tree's
        assert not sink.due(1.0) and sink.due(5.0)
        (sink.path / "checkpoint.4").write_bytes(b"")
        (sink.path / "checkpoint.3").write_bytes(b"")  # within the mark: durable before, not looked at
        again = DirectorySink(sink.path)
        assert again.recover(tree, lambda n: note(tree, n), Verifier(ORIGIN, key.public_key())) == [4]
        assert (sink.path / "checkpoint.4").read_text() == note(tree, 4)
        assert (sink.path / "checkpoint.5").read_text() == note(other, 5)
        assert (sink.path / "checkpoint.3").read_bytes() == b""
        assert again.take(0.0) == [4, 5]
