"""`tether run` takes every sidecar option and hands it to its sidecar; the sidecar's state lives outside the
working directory by default, its CA key and captures readable by the sidecar's user alone."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.cli.main import build_parser
from tether.cli.run import sidecar_namespace
from tether.cli.sidecar import SIDECAR_OPTIONS, Option

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import PYTHON, wait_until

SECRET = "k-7f3e9a1c-query-secret"


def sample(option: Option) -> tuple[list[str], object]:
    """A command-line use of the option, and the value the parser should make of it."""
    if option.action == "store_true":
        return [option.flag], True
    if option.action == "append":
        return [option.flag, "one", option.flag, "two"], ["one", "two"]
    value = "12.5" if option.type is float else f"value-of-{option.dest}"
    return [option.flag, value], float(value) if option.type is float else value


@pytest.mark.parametrize("option", [o for o in SIDECAR_OPTIONS if o.dest not in ("chain", "key", "state_dir",
                                                                                  "ready_file")],
                         ids=lambda o: o.flag)
def test_every_sidecar_option_is_accepted_by_run_and_reaches_its_sidecar_as_given(option: Option) -> None:
    use, value = sample(option)
    args = build_parser().parse_args(["run", "--chain", "c", "--key", "k", *use, "--", "true"])
    assert getattr(args, option.dest) == value
    forwarded = sidecar_namespace(args, chain="c", key="k", state_dir=Path("s"), ready=Path("r"))  # what it reads
    assert getattr(forwarded, option.dest) == value
    for other in SIDECAR_OPTIONS:  # and nothing else changed on the way
        if other.dest not in (option.dest, "chain", "key", "state_dir", "ready_file", "listen"):
            assert getattr(forwarded, other.dest) == getattr(build_parser().parse_args(
                ["sidecar", "--chain", "c", "--key", "k"]), other.dest), other.flag


def test_run_hands_on_the_chain_key_state_dir_and_ready_file_it_resolved() -> None:
    args = build_parser().parse_args(["run", "--chain", "given", "--key", "given.key", "--state-dir", "root",
                                      "--", "true"])
    forwarded = sidecar_namespace(args, chain="c", key="k", state_dir=Path("root/agent"), ready=Path("r"))
    assert (forwarded.chain, forwarded.key, forwarded.state_dir, forwarded.ready_file) == ("c", "k", "root/agent", "r")
    assert forwarded.listen == "127.0.0.1:0"  # run's own default: a free port


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("run-options"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_run_redacts_a_named_query_parameter_and_keeps_its_state_private_outside_the_cwd(
        world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("run-redact", {"issues.read": "direct"})
    work, state_home = tmp_path / "work", tmp_path / "xdg-state"
    work.mkdir()
    script = work / "agent.py"
    script.write_text("import sys, urllib.request\n"
                      f"url = sys.argv[1] + '/repos/red/act/issues?api_key={SECRET}&page=2'\n"
                      "with urllib.request.urlopen(url, timeout=10) as r:\n"
                      "    print('STATUS', r.status)\n")
    env = {k: v for k, v in world.cp.env().items() if k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")}
    env["XDG_STATE_HOME"] = str(state_home)
    done = subprocess.run([PYTHON, "-m", "tether", "run", "--chain", str(ident.chain_path),
                           "--key", str(ident.key_path), "--redact-field", "api_key", "--", PYTHON, str(script),
                           world.tools.base],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "STATUS 200" in done.stdout
    assert world.tools.hits_for("/repos/red/act/issues") == 1  # the tool got the real call; only the capture hides it

    assert sorted(p.name for p in work.iterdir()) == ["agent.py"], "the run left state in the working directory"
    state_dir = state_home / "tether" / "run-redact"
    capture = state_dir / "captures" / "flows.mitm"
    assert mode(state_dir) == 0o700
    assert mode(state_dir / "ca" / "mitmproxy-ca.pem") == 0o600  # the CA's private key
    assert mode(capture) == 0o600
    assert SECRET.encode() not in capture.read_bytes()

    har = tmp_path / "run.har"
    export = subprocess.run([PYTHON, "-m", "tether", "capture", "export", "--agent", "run-redact", "--har", str(har)],
                            cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert export.returncode == 0, export.stdout + export.stderr  # found under the default state root
    text = har.read_text()
    assert SECRET not in text
    [entry] = json.loads(text)["log"]["entries"]
    query = {q["name"]: q["value"] for q in entry["request"]["queryString"]}
    assert query["page"] == "2" and query["api_key"] != SECRET and "REDACTED" in query["api_key"]


def test_a_sidecar_creates_its_state_dir_0700(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("mode-check", {"issues.read": "direct"})
    state_dir = tmp_path / "fresh" / "mode-check"
    ready = tmp_path / "ready.json"
    log = tmp_path / "sidecar.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PYTHON, "-m", "tether", "sidecar", "--chain", str(ident.chain_path), "--key",
                                 str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
                                 "--ready-file", str(ready)], env=world.cp.env(), stdout=out, stderr=out)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60, what="the sidecar's ready file")
        assert ready.exists(), log.read_text()
        assert mode(state_dir) == 0o700
        assert mode(state_dir / "ca" / "mitmproxy-ca.pem") == 0o600
        assert os.access(state_dir / "ca" / "mitmproxy-ca-cert.pem", os.R_OK)  # the public half: for the agent
    finally:
        proc.terminate()
        proc.wait(30)


def test_run_keeps_tethers_tokens_and_secrets_from_the_command_and_its_sidecar(world: World, tmp_path: Path) -> None:
    """The README's one-shell flow exports TETHER_ADMIN_TOKEN; an agent that inherited it could approve its own
    held calls. The command reads its own environment and its sidecar's (same user: /proc/PID/environ)."""
    ident = world.cp.issue("run-authority", {"issues.read": "direct"})
    state_root = tmp_path / "state"
    script = tmp_path / "dump.py"
    script.write_text("import json, os, sys\n"
                      "ready = json.load(open(os.path.join(os.environ['TETHER_STATE_DIR'], 'run-authority', "
                      "'sidecar.ready')))\n"
                      "sidecar = open(f\"/proc/{ready['pid']}/environ\", 'rb').read().decode()\n"
                      "print(json.dumps({'own': dict(os.environ), 'sidecar': sidecar}))\n")
    env = {**world.cp.env(), "TETHER_TOKEN": "operator-token-5d1c", "RUN_SECRET": "s3cr3t-9a7e"}
    done = subprocess.run([PYTHON, "-m", "tether", "run", "--chain", str(ident.chain_path),
                           "--key", str(ident.key_path), "--state-dir", str(state_root), "--no-capture",
                           "--secret", "github=env:RUN_SECRET",
                           "--cooperative", "--", PYTHON, str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("TETHER_ADMIN_TOKEN", "TETHER_TOKEN", "RUN_SECRET"):
        assert name not in seen["own"], name
    for value in (harness.ADMIN_TOKEN, "operator-token-5d1c"):
        assert value not in json.dumps(seen["own"]) and value not in seen["sidecar"]
    assert "RUN_SECRET=s3cr3t-9a7e" in seen["sidecar"]  # the sidecar alone holds the secret it injects
    assert seen["own"]["TETHER_CONTROLPLANE"] == world.cp.url  # what it needs to delegate is still there
    assert "cooperative mode" in done.stderr  # and it was told what this mode does not govern


def test_run_refuses_isolate_with_cooperative(tmp_path: Path) -> None:
    done = subprocess.run([PYTHON, "-m", "tether", "run", "--chain", "c", "--key", "k", "--isolate", "--cooperative",
                           "--", "true"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "contradict" in done.stderr and "tether.bad_request" in done.stderr


def test_run_refuses_to_start_a_command_it_cannot_enforce_unless_asked_for_cooperative(world: World,
                                                                                    tmp_path: Path) -> None:
    """Without the means to enclose the command (here: no ip or iptables on PATH), the command does not start;
    --cooperative runs it, saying what it does not govern."""
    ident = world.cp.issue("run-unenforced", {"issues.read": "direct"})
    marker = tmp_path / "ran"
    env = {**world.cp.env(), "PATH": str(tmp_path / "empty-path")}
    base = [PYTHON, "-m", "tether", "run", "--chain", str(ident.chain_path), "--key", str(ident.key_path),
            "--state-dir", str(tmp_path / "state")]
    command = ["--", PYTHON, "-c", f"open({str(marker)!r}, 'w').write('x')"]
    refused = subprocess.run([*base, *command], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "tether.isolation_unavailable" in refused.stderr and "--cooperative" in refused.stderr
    assert not marker.exists()
    allowed = subprocess.run([*base, "--cooperative", *command], env=env, capture_output=True, text=True,
                             timeout=120)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert marker.exists() and "cooperative mode" in allowed.stderr
