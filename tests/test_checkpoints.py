"""Checkpoints leave the box: a control plane publishes signed checkpoints of its record log to a directory and
to a witness (`tether witness serve`, a real process), and `tether records verify --checkpoint` catches what the
hash chain alone cannot: a dropped tail, and a history rewritten by whoever holds the signing key."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability import keys
from tether.controlplane.notes import COSIGNATURE_V1, Verifier
from tether.controlplane.termination import seal

from .harness import PYTHON, RedisServer, free_port, prepare_controlplane, stop_process, wait_until
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


def start_witness(tmp_path: Path, log_vkey: str) -> tuple[subprocess.Popen, int, str]:
    """`tether witness serve` for one log; its process, port and cosignature verifier key."""
    if not (tmp_path / "witness.key").exists():
        assert tether("keygen", "--out", "witness.key", cwd=tmp_path).returncode == 0
    witness_key = keys.load_private((tmp_path / "witness.key").read_bytes())
    port = free_port()
    log = tmp_path / "witness.log"
    log.write_text("")
    proc = subprocess.Popen([PYTHON, "-m", "tether", "witness", "serve", "--name", "witness.test", "--key",
                             "witness.key", "--log", log_vkey, "--state", "wstate", "--listen", f"127.0.0.1:{port}"],
                            cwd=tmp_path, stderr=open(log, "ab"))
    wait_until(lambda: "listening" in log.read_text(), 30, what="the witness")
    return proc, port, Verifier("witness.test", witness_key.public_key(), COSIGNATURE_V1).vkey()


def witnessed(tmp_path: Path) -> int:
    """The log size the witness has cosigned last (its state file)."""
    (state,) = (tmp_path / "wstate").glob("*.json")
    return json.loads(state.read_text())["size"]


def test_checkpoints_reach_a_witness_and_catch_a_dropped_tail_and_a_rewritten_log(tmp_path: Path,
                                                                                   store: str) -> None:
    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    signing = keys.load_private(cp.signing_key_path.read_bytes())
    log_vkey = Verifier(ORIGIN, signing.public_key()).vkey()
    witness, port, witness_vkey = start_witness(tmp_path, log_vkey)
    cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(tmp_path / "checkpoints"), "--witness",
                  f"http://127.0.0.1:{port}")
    try:
        cp.start()
        try:
            for agent in ("a", "b", "c"):
                _terminate_one(cp, tmp_path, agent)
            latest = tmp_path / "checkpoints" / "latest"
            wait_until(lambda: latest.exists() and latest.read_text().split("\n")[1] == "3"
                       and "witness.test" in latest.read_text(), 30, what="checkpoint 3, cosigned")
            assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "latest"
            assert (tmp_path / "checkpoints" / "checkpoint.3").read_text() == latest.read_text()

            env = cp.env()
            console = cp.client().request("GET", "/v1/audit/records")  # what the console's Records page shows
            assert console["checkpoint"]["size"] == 3 and console["checkpoint"]["origin"] == ORIGIN
            assert [(w["name"], w["cosigned"], w["size"]) for w in console["checkpoint"]["witnesses"]] == [
                ("witness.test", True, 3)]
            assert all(entry["proved"] for entry in console["records"].values())
            assert tether("records", "checkpoint", "--vkey", cwd=tmp_path, env=env).stdout.strip() == log_vkey
            fetched = tether("records", "checkpoint", cwd=tmp_path, env=env).stdout
            assert fetched.startswith(f"{ORIGIN}\n3\n")
            ok = tether("records", "verify", "--checkpoint", str(latest), "--witness-key", witness_vkey,
                        cwd=tmp_path, env=env)
            assert ok.returncode == 0 and "exactly the log" in ok.stdout, ok.stdout + ok.stderr
            proof = tether("records", "prove", "--json", cwd=tmp_path, env=env)  # no id: a usage error
            assert proof.returncode == 2
            log = json.loads(tether("records", "list", "--json", cwd=tmp_path, env=env).stdout)
            (tmp_path / "record.json").write_text(json.dumps(log[1]))
            proved = tether("records", "prove", log[1]["record_id"], cwd=tmp_path, env=env)
            assert proved.returncode == 0, proved.stderr
            (tmp_path / "proof.json").write_text(proved.stdout)
        finally:
            cp.stop()

        pub = f"{cp.signing_key_path}.pub"
        one = tether("records", "verify-one", "record.json", "--proof", "proof.json", "--checkpoint", str(latest),
                     "--trust", pub, cwd=tmp_path)
        assert one.returncode == 0 and "is record 1 of the 3" in one.stdout, one.stdout + one.stderr
        edited = {**log[1], "reason": "nothing happened"}
        (tmp_path / "edited.json").write_text(json.dumps(edited))
        bad = tether("records", "verify-one", "edited.json", "--proof", "proof.json", "--checkpoint", str(latest),
                     "--trust", pub, cwd=tmp_path)
        assert bad.returncode == 1

        # The newest record dropped: the chain alone still verifies; the checkpoint does not.
        (tmp_path / "short.json").write_text(json.dumps(log[:2]))
        assert tether("records", "verify", "--file", "short.json", "--trust", pub, cwd=tmp_path).returncode == 0
        short = tether("records", "verify", "--file", "short.json", "--trust", pub, "--checkpoint", str(latest),
                       cwd=tmp_path)
        assert short.returncode == 1 and "dropped tail" in short.stdout

        # Whoever holds the key rewrites the whole chain: every hash and signature checks, the checkpoint does not.
        rewritten, prev = [], ""
        for record in log:
            body = {k: v for k, v in record.items() if k not in ("hash", "signature", "key_id")}
            body = {**body, "prev_hash": prev, **({"reason": "rewritten"} if not rewritten else {})}
            rewritten.append(seal(body, signing))
            prev = rewritten[-1]["hash"]
        (tmp_path / "rewritten.json").write_text(json.dumps(rewritten))
        assert tether("records", "verify", "--file", "rewritten.json", "--trust", pub, cwd=tmp_path).returncode == 0
        caught = tether("records", "verify", "--file", "rewritten.json", "--trust", pub, "--checkpoint",
                        str(latest), cwd=tmp_path)
        assert caught.returncode == 1 and "not the log the checkpoint commits to" in caught.stdout
        unwitnessed = tether("records", "verify", "--file", "rewritten.json", "--trust", pub, "--checkpoint",
                             str(tmp_path / "checkpoints" / "checkpoint.3"), "--witness-key",
                             Verifier("other.witness", keys.generate().public_key(), COSIGNATURE_V1).vkey(),
                             cwd=tmp_path)
        assert unwitnessed.returncode == 1 and "no cosignature by other.witness" in unwitnessed.stdout
    finally:
        stop_process(witness)


def test_a_restored_backup_and_a_crash_before_the_checkpoint(tmp_path: Path) -> None:
    """Killed between a record and its checkpoint: after the restart the checkpoint comes, and verifies. A store
    restored from a backup older than what the witness cosigned: the witness refuses the shorter log, the control
    plane says records were lost, and verify --checkpoint names the dropped tail."""
    cp = prepare_controlplane(tmp_path, 1, 2, 3)
    log_vkey = Verifier(ORIGIN, keys.load_private(cp.signing_key_path.read_bytes()).public_key()).vkey()
    witness, port, _ = start_witness(tmp_path, log_vkey)
    latest = tmp_path / "checkpoints" / "latest"
    cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(tmp_path / "checkpoints"), "--witness",
                  f"http://127.0.0.1:{port}")
    try:
        cp.start()
        _terminate_one(cp, tmp_path, "a")
        wait_until(lambda: latest.exists() and witnessed(tmp_path) == 1, 30, what="checkpoint 1 witnessed")
        cp.stop()
        for suffix in ("", "-wal", "-shm"):  # stopped: the files are the whole store
            if (tmp_path / f"tether.db{suffix}").exists():
                shutil.copy(tmp_path / f"tether.db{suffix}", tmp_path / f"backup.db{suffix}")

        cp.start()
        _terminate_one(cp, tmp_path, "b")
        cp.stop(signal.SIGKILL)  # at once: its checkpoint may not have gone out
        cp.start()
        wait_until(lambda: latest.read_text().split("\n")[1] == "2" and witnessed(tmp_path) == 2, 30,
                   what="checkpoint 2 after the restart")
        ok = tether("records", "verify", "--checkpoint", str(latest), cwd=tmp_path, env=cp.env())
        assert ok.returncode == 0, ok.stdout
        (tmp_path / "witnessed.txt").write_text(latest.read_text())
        cp.stop()

        for suffix in ("", "-wal", "-shm"):  # the restore: the log is one record shorter than what was witnessed
            (tmp_path / f"tether.db{suffix}").unlink(missing_ok=True)
            if (tmp_path / f"backup.db{suffix}").exists():
                shutil.copy(tmp_path / f"backup.db{suffix}", tmp_path / f"tether.db{suffix}")
        cp.start()
        try:
            wait_until(lambda: "records were lost or rolled back" in (tmp_path / "controlplane.log").read_text(),
                       30, what="the control plane saying the witness holds more than the log")
            assert witnessed(tmp_path) == 2  # the witness cosigned nothing shorter
            short = tether("records", "verify", "--checkpoint", "witnessed.txt", cwd=tmp_path, env=cp.env())
            assert short.returncode == 1 and "dropped tail" in short.stdout, short.stdout
            # The restored log grows another way (a fork): another record 2, where the witness cosigned the first.
            # Whoever holds that cosigned checkpoint sees the fork; the witness refuses the other history.
            _terminate_one(cp, tmp_path, "c")
            fork = tether("records", "verify", "--checkpoint", "witnessed.txt", cwd=tmp_path, env=cp.env())
            assert fork.returncode == 1 and "a fork" in fork.stdout and "dropped tail" not in fork.stdout, fork.stdout
            assert witnessed(tmp_path) == 2  # the first witness still refuses: its size-2 tree is not this one
            assert "records were lost" in (tmp_path / "controlplane.log").read_text()
        finally:
            cp.stop()
    finally:
        stop_process(witness)
        cp.stop()
