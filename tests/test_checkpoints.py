"""Checkpoints leave the box: a control plane publishes signed checkpoints of its record log to a directory and
to a witness (`tether witness serve`, a real process), and `tether records verify --checkpoint` catches what the
hash chain alone cannot: a dropped tail, and a history rewritten by whoever holds the signing key."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

from tether.capability import keys
from tether.controlplane.notes import COSIGNATURE_V1, Verifier
from tether.controlplane.termination import seal

from .harness import PYTHON, free_port, prepare_controlplane, stop_process, wait_until
from .test_keys import _terminate_one, tether

ORIGIN = "tether.test/records"


def start_witness(tmp_path: Path, log_vkey: str, name: str = "witness.test") -> tuple[subprocess.Popen, int, str]:
    """`tether witness serve` for one log, its files in ``tmp_path``; its process, port and cosignature
    verifier key."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if not (tmp_path / "witness.key").exists():
        assert tether("keygen", "--out", "witness.key", cwd=tmp_path).returncode == 0
    witness_key = keys.load_private((tmp_path / "witness.key").read_bytes())
    port = free_port()
    log = tmp_path / "witness.log"
    log.write_text("")
    proc = subprocess.Popen([PYTHON, "-m", "tether", "witness", "serve", "--name", name, "--key",
                             "witness.key", "--log", log_vkey, "--state", "wstate", "--listen", f"127.0.0.1:{port}"],
                            cwd=tmp_path, stderr=open(log, "ab"))
    wait_until(lambda: "listening" in log.read_text(), 30, what="the witness")
    return proc, port, Verifier(name, witness_key.public_key(), COSIGNATURE_V1).vkey()


def witnessed(tmp_path: Path) -> int:
    """The log size the witness has cosigned last (its state file)."""
    return witness_state(tmp_path)["size"]


def witness_state(tmp_path: Path) -> dict:
    (state,) = (tmp_path / "wstate").glob("*.json")
    return json.loads(state.read_text())


class Backup:
    """A whole store copied while its control plane is stopped, and put back later: the SQLite files, or every
    key of the Redis database (DUMP and RESTORE, with their expiries)."""

    def __init__(self, store: str, directory: Path) -> None:
        self.store, self.directory = store, directory
        self.keys: dict[bytes, tuple[int, bytes]] = {}

    def _db(self) -> Path:
        return Path(self.store.removeprefix("sqlite:///"))

    def take(self) -> None:
        if self.store.startswith("sqlite"):
            for suffix in ("", "-wal", "-shm"):
                if Path(f"{self._db()}{suffix}").exists():
                    shutil.copy(f"{self._db()}{suffix}", self.directory / f"backup{suffix}")
            return
        import redis

        r = redis.Redis.from_url(self.store)
        self.keys = {k: (max(r.pttl(k), 0), r.dump(k)) for k in r.scan_iter(count=1000)}
        r.close()
        assert self.keys

    def restore(self) -> None:
        if self.store.startswith("sqlite"):
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self._db()}{suffix}").unlink(missing_ok=True)
                if (self.directory / f"backup{suffix}").exists():
                    shutil.copy(self.directory / f"backup{suffix}", f"{self._db()}{suffix}")
            return
        import redis

        r = redis.Redis.from_url(self.store)
        r.flushdb()
        for key, (ttl, value) in self.keys.items():
            r.restore(key, ttl, value)
        r.close()


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


def test_a_restored_backup_and_a_crash_before_the_checkpoint(tmp_path: Path, store: str) -> None:
    """Killed between a record and its checkpoint: after the restart the checkpoint comes, and verifies. A store
    restored from a backup older than what the witness cosigned: the witness refuses the shorter log, the control
    plane says records were lost, and verify --checkpoint names the dropped tail."""
    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    backup = Backup(store, tmp_path)
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
        backup.take()  # stopped: the store is all there is

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

        backup.restore()  # the log is one record shorter than what was witnessed
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


def test_a_fork_shown_to_two_witnesses(tmp_path: Path, store: str) -> None:
    """Whoever holds the store and the key shows one history to one witness and another to a second: each
    cosigned checkpoint then convicts the other history (verify --checkpoint names a fork), and the first
    witness refuses to cosign the second history."""
    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    log_vkey = Verifier(ORIGIN, keys.load_private(cp.signing_key_path.read_bytes()).public_key()).vkey()
    one, port_one, vkey_one = start_witness(tmp_path / "w1", log_vkey, "witness.one")
    two, port_two, vkey_two = start_witness(tmp_path / "w2", log_vkey, "witness.two")
    latest = tmp_path / "checkpoints" / "latest"
    history = Backup(store, tmp_path)
    try:
        cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(tmp_path / "checkpoints"), "--witness",
                      f"http://127.0.0.1:{port_one}")
        cp.start()
        _terminate_one(cp, tmp_path, "a")
        wait_until(lambda: witnessed(tmp_path / "w1") == 1, 30, what="witness one at size 1")
        cp.stop()
        history.take()  # the common past of the two histories
        cp.start()
        _terminate_one(cp, tmp_path, "b")  # history A: a, b
        wait_until(lambda: witnessed(tmp_path / "w1") == 2 and latest.read_text().split("\n")[1] == "2", 30,
                   what="witness one at size 2")
        (tmp_path / "seen-by-one.txt").write_text(latest.read_text())
        log_a = json.loads(tether("records", "list", "--json", cwd=tmp_path, env=cp.env()).stdout)
        cp.stop()

        history.restore()  # history B grows from the common past: a, c; shown to both witnesses
        cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(tmp_path / "checkpoints-b"), "--witness",
                      f"http://127.0.0.1:{port_one}", "--witness", f"http://127.0.0.1:{port_two}")
        cp.start()
        try:
            _terminate_one(cp, tmp_path, "c")
            latest_b = tmp_path / "checkpoints-b" / "latest"
            wait_until(lambda: latest_b.exists() and latest_b.read_text().split("\n")[1] == "2"
                       and witnessed(tmp_path / "w2") == 2, 30, what="witness two cosigning history B")
            wait_until(lambda: "a fork" in (tmp_path / "controlplane.log").read_text(), 30,
                       what="the control plane naming witness one's refusal")
            seen_by_two = latest_b.read_text()
            assert "witness.two" in seen_by_two and "witness.one" not in seen_by_two  # one did not cosign B
            state_one = witness_state(tmp_path / "w1")
            assert state_one["size"] == 2 and "witness.one" not in seen_by_two

            # Whoever holds witness one's checkpoint sees that the log it is shown now is another history.
            fork = tether("records", "verify", "--checkpoint", "seen-by-one.txt", "--witness-key", vkey_one,
                          cwd=tmp_path, env=cp.env())
            assert fork.returncode == 1 and "a fork" in fork.stdout, fork.stdout + fork.stderr
            ok = tether("records", "verify", "--checkpoint", str(latest_b), "--witness-key", vkey_two,
                        cwd=tmp_path, env=cp.env())
            assert ok.returncode == 0, ok.stdout + ok.stderr
            # B's checkpoint asked of witness one's key: not cosigned by it.
            lone = tether("records", "verify", "--checkpoint", str(latest_b), "--witness-key", vkey_one,
                          cwd=tmp_path, env=cp.env())
            assert lone.returncode == 1 and "no cosignature by witness.one" in lone.stdout, lone.stdout
        finally:
            cp.stop()
        # And history A, offline, against B's witnessed checkpoint: the same fork, seen from the other side.
        (tmp_path / "log-a.json").write_text(json.dumps(log_a))
        other = tether("records", "verify", "--file", "log-a.json", "--trust", f"{cp.signing_key_path}.pub",
                       "--checkpoint", str(tmp_path / "checkpoints-b" / "latest"), cwd=tmp_path)
        assert other.returncode == 1 and "a fork" in other.stdout, other.stdout
    finally:
        stop_process(one)
        stop_process(two)
        cp.stop()


def test_a_witness_refuses_a_log_rewritten_with_the_signing_key(tmp_path: Path, store: str) -> None:
    """The whole chain re-signed by whoever holds the key, in a new store the control plane is then pointed at:
    every hash and signature checks, but the witness that cosigned the real log refuses the rewritten one, the
    control plane says so, and the witnessed checkpoint convicts it."""
    import asyncio

    from tether.controlplane.store import open_store_url

    cp = prepare_controlplane(tmp_path, 1, 2, 3, store=store)
    signing = keys.load_private(cp.signing_key_path.read_bytes())
    witness, port, witness_vkey = start_witness(tmp_path, Verifier(ORIGIN, signing.public_key()).vkey())
    latest = tmp_path / "checkpoints" / "latest"
    cp.options = ("--log-origin", ORIGIN, "--checkpoint-dir", str(tmp_path / "checkpoints"), "--witness",
                  f"http://127.0.0.1:{port}")
    try:
        cp.start()
        for agent in ("a", "b", "c"):
            _terminate_one(cp, tmp_path, agent)
        wait_until(lambda: witnessed(tmp_path) == 3, 30, what="the witness at size 3")
        # the directory writes its files in the batch, up to --checkpoint-sync (5 s) after the witness saw them
        wait_until(lambda: latest.exists() and latest.read_text().split("\n")[1] == "3"
                   and "witness.test" in latest.read_text(), 30, what="checkpoint 3, cosigned, in the directory")
        (tmp_path / "witnessed.txt").write_text(latest.read_text())
        log = json.loads(tether("records", "list", "--json", cwd=tmp_path, env=cp.env()).stdout)
        cp.stop()

        rewritten, prev = [], ""
        for record in log:
            body = {k: v for k, v in record.items() if k not in ("hash", "signature", "key_id")}
            body = {**body, "prev_hash": prev, **({"reason": "rewritten"} if not rewritten else {})}
            rewritten.append(seal(body, signing))
            prev = rewritten[-1]["hash"]
        forged = (f"sqlite:///{tmp_path / 'forged.db'}" if store.startswith("sqlite")
                  else store.rsplit("/", 1)[0] + "/1")

        async def write() -> None:
            target = open_store_url(forged)
            await target.open()
            try:
                for record in rewritten:
                    assert await target.append_record(record)
            finally:
                await target.close()

        asyncio.run(write())
        cp.store = forged
        cp.start()
        try:
            wait_until(lambda: "another log of the same size" in (tmp_path / "controlplane.log").read_text(), 30,
                       what="the control plane naming the witness's refusal")
            state = witness_state(tmp_path)
            assert state["size"] == 3
            chain = tether("records", "verify", cwd=tmp_path, env=cp.env())
            assert chain.returncode == 0, chain.stdout  # the chain alone: every hash and signature checks
            caught = tether("records", "verify", "--checkpoint", "witnessed.txt", "--witness-key", witness_vkey,
                            cwd=tmp_path, env=cp.env())
            assert caught.returncode == 1 and "not the log the checkpoint commits to" in caught.stdout, caught.stdout
        finally:
            cp.stop()
    finally:
        stop_process(witness)
        cp.stop()
