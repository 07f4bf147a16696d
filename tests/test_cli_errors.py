"""User errors end in a message and an exit status, never a traceback; Ctrl-C ends a long-running command with
130. Every case runs the real `tether` in a subprocess (and a real control plane and sidecar where it needs one)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import PYTHON, free_port, wait_until


def tether(*args: str, cwd: Path, env: dict[str, str] | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tether", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60, **kw)  # type: ignore[call-overload]


def clean(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


class Background:
    """A long-running `tether` command with its stderr in a file, read as it grows."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.log = cwd / f"bg-{args[0]}-{os.getpid()}-{id(self)}.log"
        with open(self.log, "wb") as out:
            # Ctrl-C as a terminal delivers it: whatever the test runner's own SIGINT disposition is (a parallel
            # worker ignores it, and an ignored signal stays ignored across exec), the command starts with the
            # default one, as from a shell.
            self.proc = subprocess.Popen([PYTHON, "-m", "tether", *args], cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"},
                                         stdout=out, stderr=out,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 60, count: int = 1) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None and self.text.count(needle) < count:
                raise AssertionError(f"exited {self.proc.returncode} before {needle!r}:\n{self.text[-3000:]}")
            return self.text.count(needle) >= count

        wait_until(seen, timeout, interval=0.1, what=repr(needle))

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(30)

    def stop(self) -> None:
        harness.stop_process(self.proc)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("cli-errors"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


# -- no control plane needed -------------------------------------------------------------------------------
def test_an_unknown_command_lists_the_commands(tmp_path: Path) -> None:
    out = tether("frobnicate", cwd=tmp_path)
    assert out.returncode == 2 and "invalid choice: 'frobnicate'" in out.stderr and "sidecar" in out.stderr
    clean(out)


def test_version(tmp_path: Path) -> None:
    out = tether("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("tether ")


def test_revoke_with_a_chain_but_no_key_says_what_is_missing(tmp_path: Path) -> None:
    out = tether("revoke", "some-jti", "--chain", "principal.chain", cwd=tmp_path)
    assert out.returncode == 2 and "--chain needs --key" in out.stderr
    clean(out)


def test_capture_export_without_its_captures_dir_fails(tmp_path: Path) -> None:
    out = tether("capture", "export", "--agent", "a", "--har", "out.har", "--captures", "no-such-dir", cwd=tmp_path)
    assert out.returncode == 2 and "no-such-dir" in out.stderr and "--captures" in out.stderr
    assert not (tmp_path / "out.har").exists()
    clean(out)


def test_a_command_against_an_unreachable_control_plane_names_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = tether("agents", "--controlplane", url, cwd=tmp_path)
    assert out.returncode == 2 and "tether.controlplane_unreachable" in out.stderr and url in out.stderr
    clean(out)


def test_control_plane_on_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = tether("controlplane", "serve", "--listen", f"127.0.0.1:{port}", "--store",
                     f"sqlite:///{tmp_path / 'cp.db'}", cwd=tmp_path, env={**os.environ, "TETHER_ADMIN_TOKEN": "t"})
    assert out.returncode == 2 and "tether.listen_failed" in out.stderr and "in use" in out.stderr
    assert f"127.0.0.1:{port}" in out.stderr
    clean(out)


def test_ctrl_c_stops_the_control_plane_with_130(tmp_path: Path) -> None:
    port = free_port()
    bg = Background(["controlplane", "serve", "--listen", f"127.0.0.1:{port}", "--store",
                     f"sqlite:///{tmp_path / 'cp.db'}"], tmp_path, {**os.environ, "TETHER_ADMIN_TOKEN": "t"})
    try:
        bg.wait_for("listening on")
        assert bg.interrupt() == 130
        assert "Traceback" not in bg.text
    finally:
        bg.stop()


# -- against a control plane -------------------------------------------------------------------------------
def test_a_reader_that_leaves_is_no_error(world: World, tmp_path: Path) -> None:
    """`tether agents --json | head -0`: the pipe's reader is gone before anything is written."""
    world.cp.issue("pipe-reader", {"issues.read": "direct"})
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([PYTHON, "-m", "tether", "agents", "--json"], cwd=tmp_path, env=world.cp.env(),
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert out.returncode == 141, out.stderr
    assert out.stderr == ""


def sidecar_args(world: World, agent: str, tmp_path: Path, *extra: str) -> list[str]:
    ident = world.cp.issue(agent, {"issues.read": "direct"})
    return ["sidecar", "--chain", str(ident.chain_path), "--key", str(ident.key_path), "--state-dir",
            str(tmp_path / agent), "--ready-file", str(tmp_path / f"{agent}.ready"), *extra]


def test_sidecar_on_a_port_in_use(world: World, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([PYTHON, "-m", "tether", *sidecar_args(world, "port-taken", tmp_path, "--listen",
                                                                  f"127.0.0.1:{port}")],
                             cwd=tmp_path, env=world.cp.env(), capture_output=True, text=True, timeout=90)
    assert out.returncode == 2 and "tether.listen_failed" in out.stderr and "in use" in out.stderr, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr
    clean(out)
    agents = world.cp.client().request("GET", "/v1/agents")["agents"]
    assert not [a for a in agents if a["agent"] == "port-taken" and a["sidecar"]], "a run that never served"


def test_sidecar_waits_for_an_unreachable_control_plane_saying_so_and_serves_once_it_is_up(
        world: World, tmp_path: Path) -> None:
    late = harness.prepare_controlplane(tmp_path / "late-cp", world.tools.port, world.secure.port, world.mcp.port)
    ident = late.issue("patient", {"issues.read": "direct"})
    ready = tmp_path / "patient.ready"
    bg = Background(["sidecar", "--controlplane", late.url, "--chain", str(ident.chain_path), "--key",
                     str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "patient"),
                     "--ready-file", str(ready)], tmp_path, late.env())
    try:
        status = f"waiting for the control plane at {late.url}"
        bg.wait_for(status, count=2)  # said, and said again: still trying
        assert bg.proc.poll() is None and "Traceback" not in bg.text
        late.start()
        wait_until(ready.exists, 60, what="the sidecar serving once its control plane is up")
        assert bg.interrupt() == 130  # Ctrl-C while serving
        assert "Traceback" not in bg.text
    finally:
        bg.stop()
        late.stop()


def test_ctrl_c_while_waiting_for_the_control_plane(tmp_path: Path) -> None:
    cp = harness.prepare_controlplane(tmp_path / "never", 1, 2, 3)  # never started
    ident = cp.issue("given-up", {"issues.read": "direct"})
    bg = Background(["sidecar", "--controlplane", cp.url, "--chain", str(ident.chain_path), "--key",
                     str(ident.key_path), "--state-dir", str(tmp_path / "s")], tmp_path, cp.env())
    try:
        bg.wait_for(f"waiting for the control plane at {cp.url}")
        assert bg.interrupt() == 130
        assert "Traceback" not in bg.text
    finally:
        bg.stop()


def test_run_relays_the_sidecars_wait_and_ctrl_c_ends_it_with_130(tmp_path: Path) -> None:
    cp = harness.prepare_controlplane(tmp_path / "never", 1, 2, 3)  # never started
    ident = cp.issue("run-waits", {"issues.read": "direct"})
    bg = Background(["run", "--controlplane", cp.url, "--chain", str(ident.chain_path), "--key", str(ident.key_path),
                     "--state-dir", str(tmp_path / "state"), "--", PYTHON, "-c", "print('never runs')"],
                    tmp_path, cp.env())
    try:
        bg.wait_for(f"waiting for the control plane at {cp.url}")
        status = bg.interrupt()
        assert "Traceback" not in bg.text and "never runs" not in bg.text
        assert status == 130
    finally:
        bg.stop()


def test_a_ctrl_c_that_ends_code_run_from_a_string_still_exits_130(tmp_path: Path) -> None:
    """A Ctrl-C that lands while a module is imported often ends code run from a string (every ``@dataclass``
    is): CPython then marks the interrupt unhandled, and under ``python -m`` kills itself by SIGINT at exit
    whatever status was returned, unless tether's handler clears that mark. Raised here on purpose, in the
    same place, so the check does not depend on when a signal lands."""
    (tmp_path / "interrupted_start.py").write_text(
        "import sys\n"
        "from tether.cli import main as cli\n"
        "class Interrupting:\n"
        "    def __init__(self, only=None):\n"
        "        pass\n"
        "    def parse_args(self, argv):\n"
        "        exec('raise KeyboardInterrupt')\n"
        "cli.build_parser = Interrupting\n"
        "sys.exit(cli.main([]))\n")
    result = subprocess.run([PYTHON, "-m", "interrupted_start"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 130, result.stderr
    clean(result)


def test_ctrl_c_ends_a_running_command_under_run_with_130(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("run-interrupted", {"issues.read": "direct"})
    script = tmp_path / "agent.py"
    # Ctrl-C's default action (no KeyboardInterrupt): the command dies by SIGINT, as most programs do
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                      "print('agent started', flush=True)\ntime.sleep(120)\n")
    bg = Background(["run", "--chain", str(ident.chain_path), "--key", str(ident.key_path), "--state-dir",
                     str(tmp_path / "state"), "--", PYTHON, str(script)], tmp_path, world.cp.env())
    try:
        bg.wait_for("agent started")
        assert bg.interrupt() == 130
        assert "Traceback" not in bg.text
    finally:
        bg.stop()


def test_ctrl_c_stops_the_demo_with_130(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    bg = Background(["demo", "--fast", "--dir", str(tmp_path / "demo")], tmp_path, env)
    try:
        bg.wait_for("Run the root agent under tether", timeout=120)
        assert bg.interrupt() == 130
        assert "Traceback" not in bg.text
    finally:
        bg.stop()
