"""``tether node serve``: each ``tether run --node`` is a fork of one pre-loaded server, with its own identity,
sidecar and failure domain; its caller stays only as a ``/bin/sh`` shim relaying signals and the exit status.
Also the start-up errors of ``tether run`` itself (issue 27): a command that does not exist, and an earlier
run's log lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import PYTHON, wait_until

AGENT = """import os, sys, time, urllib.request
print('PID', os.getpid(), flush=True)
def call(tag):
    with urllib.request.urlopen(sys.argv[1] + f'/repos/node/{tag}/issues', timeout=20) as r:
        print('STATUS', tag, r.status, flush=True)
call('first')
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.05)
call('second')
sys.exit(int(sys.argv[3]))
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("node"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


@pytest.fixture
def node(world: World, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    sock = tmp_path / "state" / "node.sock"
    env = world.cp.env()  # the operator's shell exports the admin token: the server drops it
    server = subprocess.Popen([PYTHON, "-m", "tether", "node", "serve", "--socket", str(sock)], env=env,
                              stderr=open(tmp_path / "node.log", "w"))
    try:
        wait_until(lambda: sock.exists() or server.poll() is not None, 60, what="the node server's socket")
        assert server.poll() is None, (tmp_path / "node.log").read_text()
        yield server, sock
    finally:
        server.terminate()
        server.wait(30)


def start_run(world: World, tmp_path: Path, sock: Path, agent: str, code: int) -> tuple[subprocess.Popen, Path, Path]:
    ident = world.cp.issue(agent, {"issues.read": "direct"})
    script, go, out = tmp_path / f"{agent}.py", tmp_path / f"{agent}.go", tmp_path / f"{agent}.out"
    script.write_text(AGENT)
    proc = subprocess.Popen([PYTHON, "-m", "tether", "run", "--node", str(sock), "--cooperative", "--chain",
                             str(ident.chain_path), "--key", str(ident.key_path), "--state-dir",
                             str(tmp_path / "state"), "--", PYTHON, str(script), world.tools.base, str(go), str(code)],
                            env=world.cp.env(), stdout=open(out, "w"), stderr=subprocess.STDOUT)
    wait_until(lambda: "STATUS first 200" in out.read_text() or proc.poll() is not None, 90,
               what=f"{agent}'s first call")
    assert proc.poll() is None, out.read_text()
    return proc, go, out


def ready_pid(tmp_path: Path, agent: str) -> int:
    return int(json.loads((tmp_path / "state" / agent / "sidecar.ready").read_text())["pid"])


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def test_runs_forked_by_a_node_serve_their_own_agents_and_one_killed_takes_no_other(
        world: World, tmp_path: Path, node: tuple[subprocess.Popen, Path]) -> None:
    server, sock = node
    a, _go_a, out_a = start_run(world, tmp_path, sock, "node-a", 0)
    b, go_b, out_b = start_run(world, tmp_path, sock, "node-b", 5)
    fork_a, fork_b = ready_pid(tmp_path, "node-a"), ready_pid(tmp_path, "node-b")
    assert parent_of(fork_a) == parent_of(fork_b) == server.pid  # forked by the server, not started by the caller
    for pid in (server.pid, fork_a):  # what a same-user command could read of them
        assert harness.ADMIN_TOKEN.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    for caller in (a, b):  # the caller is a shell now, not a Python process
        assert Path(f"/proc/{caller.pid}/comm").read_text().strip() != Path(f"/proc/{fork_a}/comm").read_text().strip()
        assert "python" not in os.readlink(f"/proc/{caller.pid}/exe")
    agents = {x["agent"]: x for x in world.cp.client().request("GET", "/v1/agents")["agents"]}
    assert agents["node-a"]["sidecar"] and agents["node-b"]["sidecar"]

    command_a = int(next(line.split()[1] for line in out_a.read_text().splitlines() if line.startswith("PID ")))
    os.kill(fork_a, signal.SIGKILL)  # a crash of one agent's process
    assert a.wait(30) == 2
    assert "tether.sidecar_failed" in out_a.read_text()
    # Its command goes with it (it would find no way out anyway): nothing of the crashed agent is left running.
    wait_until(lambda: not Path(f"/proc/{command_a}").exists()
               or "zombie" in Path(f"/proc/{command_a}/status").read_text(), 30, what="the crashed agent's command")
    go_b.touch()  # the other still serves its agent, and its command's status comes back through the shim
    assert b.wait(60) == 5, out_b.read_text()
    assert "STATUS second 200" in out_b.read_text()
    assert server.poll() is None
    hits = world.tools.hits_for("/repos/node/second/issues")
    assert hits == 1


def test_a_signal_to_the_caller_reaches_the_command_and_the_status_comes_back(
        world: World, tmp_path: Path, node: tuple[subprocess.Popen, Path]) -> None:
    _server, sock = node
    proc, _go, out = start_run(world, tmp_path, sock, "node-signalled", 0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, out.read_text()  # the command died by it; run said so
    log = (tmp_path / "state" / "node-signalled" / "sidecar.log").read_text()
    assert "listening" in log  # its own log, in its own state dir


def test_run_says_when_no_node_server_answers(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("node-absent", {"issues.read": "direct"})
    done = subprocess.run([PYTHON, "-m", "tether", "run", "--node", str(tmp_path / "none.sock"), "--chain",
                           str(ident.chain_path), "--key", str(ident.key_path), "--", "true"],
                          env=world.cp.env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "tether.node_unavailable" in done.stderr, done.stderr


def test_run_refuses_a_command_that_does_not_exist_before_starting_anything(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("no-program", {"issues.read": "direct"})
    done = subprocess.run([PYTHON, "-m", "tether", "run", "--chain", str(ident.chain_path), "--key",
                           str(ident.key_path), "--state-dir", str(tmp_path / "state"), "--",
                           "no-such-program-7c1e"], env=world.cp.env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 127, done.stderr
    assert "error: tether.command_not_found: no-such-program-7c1e" in done.stderr
    assert not (tmp_path / "state" / "no-program").exists()  # no sidecar, no state dir


def test_a_failed_run_says_its_own_failure_not_an_earlier_runs_log(world: World, tmp_path: Path) -> None:
    other = harness.prepare_controlplane(tmp_path / "other-cp", 1, 2, 3)  # another signing key: a foreign chain
    ident = other.issue("foreign", {"issues.read": "direct"})
    state = tmp_path / "state" / "foreign"
    state.mkdir(parents=True)
    (state / "sidecar.log").write_text("tether: a line of an earlier run 3e9b\nERROR something else went wrong\n")
    done = subprocess.run([PYTHON, "-m", "tether", "run", "--cooperative", "--chain", str(ident.chain_path), "--key",
                           str(ident.key_path), "--state-dir", str(tmp_path / "state"), "--", sys.executable, "-c",
                           "print('never runs')"], env=world.cp.env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 2, done.stderr
    assert "tether.chain_invalid" in done.stderr
    assert "3e9b" not in done.stderr and "never runs" not in done.stdout


def test_an_enforced_command_cannot_reach_the_node_server_it_was_forked_from(world: World, tmp_path: Path) -> None:
    """The socket would start unenforced runs outside the enclosure: it is covered inside, even away from the
    state root."""
    sock = tmp_path / "elsewhere" / "node.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    server = subprocess.Popen([PYTHON, "-m", "tether", "node", "serve", "--socket", str(sock)], env=env,
                              stderr=open(tmp_path / "node.log", "w"))
    try:
        wait_until(lambda: sock.exists() or server.poll() is not None, 60, what="the node server's socket")
        ident = world.cp.issue("node-enclosed", {"issues.read": "direct"})
        probe = ("import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(" + repr(str(sock)) + ")\n"
                 "    print('REACHED')\nexcept OSError as e:\n    print('REFUSED', type(e).__name__)\n")
        done = subprocess.run([PYTHON, "-m", "tether", "run", "--node", str(sock), "--chain", str(ident.chain_path),
                               "--key", str(ident.key_path), "--state-dir", str(tmp_path / "state"), "--", PYTHON,
                               "-c", probe], env=world.cp.env(), capture_output=True, text=True, timeout=120)
        if "tether.isolation_unavailable" in done.stderr:
            pytest.skip(f"enforcement is not available here: {done.stderr.strip()[-300:]}")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "runs enforced" in done.stderr
        assert "REFUSED" in done.stdout and "REACHED" not in done.stdout, done.stdout
        assert server.poll() is None  # and it still serves the node
    finally:
        server.terminate()
        server.wait(30)
