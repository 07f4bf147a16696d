"""Keys are never lost by accident: keygen refuses to overwrite, replicas starting together share one key, and a
control plane refuses a signing key that did not sign the record log it would extend (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from tether.capability import keys

from .harness import ADMIN_TOKEN, PYTHON, ControlPlaneProcess, RedisServer, free_port, prepare_controlplane


def tether(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tether", *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=env or {**os.environ, "TETHER_ADMIN_TOKEN": ADMIN_TOKEN})


def test_keygen_refuses_an_existing_key_and_force_keeps_the_old_one_beside(tmp_path: Path) -> None:
    first = tether("keygen", "--out", "agent.key", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "agent.key").read_bytes(), (tmp_path / "agent.key.pub").read_bytes()

    again = tether("keygen", "--out", "agent.key", cwd=tmp_path)
    assert again.returncode == 2
    assert "tether.file_exists" in again.stderr and "agent.key" in again.stderr
    assert ((tmp_path / "agent.key").read_bytes(), (tmp_path / "agent.key.pub").read_bytes()) == before

    (tmp_path / "agent.key").unlink()  # the public half alone is still a key someone trusts
    lone = tether("keygen", "--out", "agent.key", cwd=tmp_path)
    assert lone.returncode == 2 and "agent.key.pub" in lone.stderr
    assert not (tmp_path / "agent.key").exists()
    (tmp_path / "agent.key").write_bytes(before[0])
    (tmp_path / "agent.key").chmod(0o600)

    forced = tether("keygen", "--out", "agent.key", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    kept = sorted(p.name for p in tmp_path.iterdir() if ".replaced-" in p.name)
    assert len(kept) == 2
    old_private = next(p for p in tmp_path.iterdir() if p.name.startswith("agent.key.replaced-"))
    old_public = next(p for p in tmp_path.iterdir() if p.name.startswith("agent.key.pub.replaced-"))
    assert (old_private.read_bytes(), old_public.read_bytes()) == before
    assert old_private.stat().st_mode & 0o777 == 0o600
    new = keys.load_private((tmp_path / "agent.key").read_bytes())
    assert keys.public_pem(new.public_key()) == (tmp_path / "agent.key.pub").read_bytes() != before[1]
    assert (tmp_path / "agent.key").stat().st_mode & 0o777 == 0o600


def _trust_of(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url + "/v1/trust", timeout=5) as resp:
        return json.load(resp)["jwk"]


def _start_together(procs: list[ControlPlaneProcess]) -> None:
    """Start every replica's process at one instant (threads released by one barrier)."""
    barrier = threading.Barrier(len(procs))
    errors: list[BaseException] = []

    def go(p: ControlPlaneProcess) -> None:
        barrier.wait()
        try:
            p.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_replicas_started_at_once_in_one_directory_share_one_new_key(tmp_path: Path, store: str) -> None:
    redis = RedisServer(tmp_path / "redis").start() if store == "redis" else None
    try:
        base = prepare_controlplane(tmp_path, 1, 2, 3)
        base.signing_key_path.unlink()
        Path(f"{base.signing_key_path}.pub").unlink()
        url = redis.url() if redis else f"sqlite:///{tmp_path / 'tether.db'}"
        procs = [ControlPlaneProcess(tmp_path, store=url, port=free_port()) for _ in range(3)]
        _start_together(procs)
        try:
            trusted = {json.dumps(_trust_of(p.url), sort_keys=True) for p in procs}
            assert len(trusted) == 1
            on_disk = keys.load_private(base.signing_key_path.read_bytes())
            assert json.loads(trusted.pop()) == keys.to_jwk(on_disk.public_key())
            assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".signing.key.")]
        finally:
            for p in procs:
                p.stop()
    finally:
        if redis:
            redis.stop()


def test_a_control_plane_refuses_a_signing_key_that_did_not_sign_its_log(tmp_path: Path) -> None:
    cp = prepare_controlplane(tmp_path, 1, 2, 3).start()
    try:
        env = cp.env()
        assert tether("keygen", "--out", "a.key", cwd=tmp_path).returncode == 0
        issued = tether("grant", "issue", "--signing-key", str(cp.signing_key_path), "--catalog", str(cp.catalog_path),
                        "--agent", "planner", "--subject-key", "a.key.pub", "--role", "reader", "--out", "a.chain",
                        cwd=tmp_path, env=env)
        assert issued.returncode == 0, issued.stderr
        registered = tether("grant", "register", "--chain", "a.chain", "--key", "a.key", cwd=tmp_path, env=env)
        assert registered.returncode == 0, registered.stderr
        done = tether("terminate", "planner", "--window", "0", "--wait", cwd=tmp_path, env=env)
        assert done.returncode == 1 and "record rec-" in done.stdout, done.stderr + done.stdout  # 1: unaccounted
        head = cp.client().request("GET", "/v1/records")[-1]
    finally:
        cp.stop()
    ours = keys.load_private(cp.signing_key_path.read_bytes())
    assert head["key_id"] == keys.thumbprint(ours.public_key())

    replaced = tether("keygen", "--out", str(cp.signing_key_path), "--force", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    new = keys.load_private(cp.signing_key_path.read_bytes())
    started = subprocess.run(
        [PYTHON, "-m", "tether", "controlplane", "serve", "--listen", f"127.0.0.1:{free_port()}",
         "--store", f"sqlite:///{tmp_path / 'tether.db'}", "--catalog", str(cp.catalog_path),
         "--signing-key", str(cp.signing_key_path)],
        capture_output=True, text=True, timeout=60, env=cp.env())
    assert started.returncode == 2
    assert "tether.signing_key_mismatch" in started.stderr
    assert keys.thumbprint(new.public_key()) in started.stderr and head["key_id"] in started.stderr
    assert "Traceback" not in started.stderr

    kept = next(p for p in tmp_path.iterdir() if p.name.startswith("signing.key.replaced-"))
    os.replace(kept, cp.signing_key_path)  # the right key back: it starts, and the log still verifies
    cp.start()
    try:
        verify = tether("records", "verify", "--controlplane", cp.url, cwd=tmp_path, env=cp.env())
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        cp.stop()


def _terminate_one(cp: ControlPlaneProcess, tmp_path: Path, agent: str) -> None:
    """A record in the log: a registered chain for ``agent`` (signed offline with the key in force), terminated."""
    env = cp.env()
    assert tether("keygen", "--out", f"{agent}.key", cwd=tmp_path).returncode == 0
    issued = tether("grant", "issue", "--signing-key", str(cp.signing_key_path), "--catalog", str(cp.catalog_path),
                    "--agent", agent, "--subject-key", f"{agent}.key.pub", "--role", "reader", "--out",
                    f"{agent}.chain", cwd=tmp_path, env=env)
    assert issued.returncode == 0, issued.stderr
    registered = tether("grant", "register", "--chain", f"{agent}.chain", "--key", f"{agent}.key", cwd=tmp_path,
                        env=env)
    assert registered.returncode == 0, registered.stderr
    done = tether("terminate", agent, "--window", "0", "--wait", cwd=tmp_path, env=env)
    assert "record rec-" in done.stdout, done.stderr + done.stdout


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_rotation_is_announced_in_the_log_and_verify_holds_across_it(tmp_path: Path, store: str) -> None:
    redis = RedisServer(tmp_path / "redis").start() if store == "redis" else None
    try:
        cp = prepare_controlplane(tmp_path, 1, 2, 3)
        cp.store = redis.url() if redis else f"sqlite:///{tmp_path / 'tether.db'}"
        old_pub = tmp_path / "old.pub"
        old_pub.write_bytes(Path(f"{cp.signing_key_path}.pub").read_bytes())
        cp.start()
        try:
            _terminate_one(cp, tmp_path, "before")
        finally:
            cp.stop()

        rotated = tether("keys", "rotate", "--signing-key", str(cp.signing_key_path), "--store", cp.store,
                         "--reason", "test", cwd=tmp_path)
        assert rotated.returncode == 0, rotated.stderr
        old_key = next(p for p in tmp_path.iterdir() if p.name.startswith("signing.key.replaced-"))
        assert keys.public_pem(keys.load_private(old_key.read_bytes()).public_key()) == old_pub.read_bytes()
        new_pub = Path(f"{cp.signing_key_path}.pub").read_bytes()
        assert new_pub != old_pub.read_bytes()

        stale = subprocess.run(  # a replica still holding the old key: refused, naming the rotation
            [PYTHON, "-m", "tether", "controlplane", "serve", "--listen", f"127.0.0.1:{free_port()}", "--store",
             cp.store, "--catalog", str(cp.catalog_path), "--signing-key", str(old_key)],
            capture_output=True, text=True, timeout=60, env=cp.env())
        assert stale.returncode == 2 and "tether.signing_key_mismatch" in stale.stderr
        assert "a rotation to key" in stale.stderr

        cp.start()
        try:
            _terminate_one(cp, tmp_path, "after")
            listed = tether("records", "list", "--json", cwd=tmp_path, env=cp.env())
            assert listed.returncode == 0, listed.stderr
            log = json.loads(listed.stdout)
            assert [r.get("kind", "termination") for r in log] == ["termination", "key_rotation", "termination"]
            assert log[0]["key_id"] == log[1]["key_id"] == log[1]["old_key_id"] != log[2]["key_id"]
            assert log[2]["key_id"] == log[1]["new_key_id"]
            online = tether("records", "verify", cwd=tmp_path, env=cp.env())
            assert online.returncode == 0 and "3 record(s)" in online.stdout, online.stdout + online.stderr
            (tmp_path / "log.json").write_text(listed.stdout)
        finally:
            cp.stop()
        for trusted in (old_pub, Path(f"{cp.signing_key_path}.pub")):  # either key follows the log
            offline = tether("records", "verify", "--file", "log.json", "--trust", str(trusted), cwd=tmp_path)
            assert offline.returncode == 0, offline.stdout
        assert tether("keygen", "--out", "stranger.key", cwd=tmp_path).returncode == 0
        strange = tether("records", "verify", "--file", "log.json", "--trust", "stranger.key.pub", cwd=tmp_path)
        assert strange.returncode == 1 and "none of the keys that signed this log" in strange.stdout
    finally:
        if redis:
            redis.stop()


def test_a_rotation_needs_the_new_keys_signature_and_the_key_in_force() -> None:
    from tether.controlplane.rotation import cross_sign, rotation_record
    from tether.controlplane.termination import seal, verify_records

    k0, k1, thief = keys.generate(), keys.generate(), keys.generate()
    first = seal({"record_id": "r0", "calls": [], "prev_hash": ""}, k0)
    rotation = seal(cross_sign(rotation_record(record_id="r1", prev_hash=first["hash"], old=k0, new=k1, by="t",
                                               reason="", now=1.0), k1), k0)
    after = seal({"record_id": "r2", "calls": [], "prev_hash": rotation["hash"]}, k1)
    assert verify_records([first, rotation, after], k1.public_key()).ok
    assert verify_records([first, rotation, after], k0.public_key()).ok
    # Someone holding only the old key announces a rotation to a key of their own: the cross-signature fails.
    forged = seal(cross_sign(rotation_record(record_id="r1", prev_hash=first["hash"], old=k0, new=thief, by="t",
                                             reason="", now=1.0), k1), k0)
    forged_after = seal({"record_id": "r2", "calls": [], "prev_hash": forged["hash"]}, thief)
    result = verify_records([first, forged, forged_after], k0.public_key())
    assert not result.ok and any("did not sign its own rotation" in p for p in result.problems)
    # A record after the rotation still signed with the old key.
    late = seal({"record_id": "r2", "calls": [], "prev_hash": rotation["hash"]}, k0)
    result = verify_records([first, rotation, late], k1.public_key())
    assert not result.ok and any("in force then" in p for p in result.problems)
