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

from capability import keys

from .harness import ADMIN_TOKEN, PYTHON, ControlPlaneProcess, RedisServer, free_port, prepare_controlplane


def tether(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "cli", *args], cwd=cwd, capture_output=True, text=True, timeout=60,
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
        [PYTHON, "-m", "cli", "controlplane", "serve", "--listen", f"127.0.0.1:{free_port()}",
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
