"""The CLI's habits, as a user meets them: the real `python -m tether` in a subprocess, against a real control
plane (tests/harness.py) and, where a command needs one, a real sidecar. Covered: a jti prefix accepted wherever a
jti is taken (refused when too short or ambiguous); `revoke --agent` as a principal; usage errors with the
command's own usage and a code; `--json` on every listing and verdict; ISO 8601 UTC times; `NO_COLOR`; shell
completion from the parser; `terminate --wait`'s progress on and off a terminal, and on Ctrl-C; a termination of an
agent that never ran a sidecar; aligned tables; `controlplane serve` refusing a catalog before it makes up a token."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import mint_root

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import PYTHON, wait_until

ISO_UTC = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\b")
EPOCH = re.compile(r"\b1[5-9]\d{8}(\.\d+)?\b")  # a Unix time in seconds, 2017 to 2033


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("cli-habits"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


def tether(world: World | None, *args: str, cwd: Path, env: dict[str, str] | None = None,
           timeout: float = 90) -> subprocess.CompletedProcess[str]:
    base = world.cp.env() if world is not None else {**os.environ}
    return subprocess.run([PYTHON, "-m", "tether", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr + result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess[str], code: str, status: int = 2) -> str:
    assert result.returncode == status, result.stderr + result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    assert f"error: {code}: " in result.stderr, result.stderr
    return result.stderr


def register(world: World, wire: str) -> None:
    world.cp.client().request("POST", "/v1/chains/register", {"chain": wire})


def root_with_jti(world: World, agent: str, jti: str) -> str:
    """A root link whose jti the test chooses (two sharing a prefix make it ambiguous), registered."""
    signing = keys.load_private(world.cp.signing_key_path.read_bytes())
    catalog = parse_catalog(world.cp.catalog_path.read_text(), str(world.cp.catalog_path))
    wire = mint_root(signing, agent=agent, subject_key=keys.generate().public_key(), caps={"issues.read": "direct"},
                     now=time.time(), ttl_s=3600, depth=2, catalog=catalog, jti=jti)
    register(world, wire)
    return wire


def tree_jti(tree: str, agent: str) -> str:
    line = next(line for line in tree.splitlines() if re.search(rf"(^|── ){re.escape(agent)}  \[", line))
    found = re.search(r"jti ([0-9a-f]+)(\S*)", line)
    assert found is not None, line
    assert found.group(2) == "", f"the tree prints the jti with something revoke does not take: {line}"
    return found.group(1)


# -- jti prefixes --------------------------------------------------------------------------------------------
def test_the_jti_the_tree_prints_is_what_revoke_and_budgets_take(world: World, tmp_path: Path) -> None:
    planner = world.cp.issue("prefix-planner", {"issues.read": "direct"})
    coder = world.cp.delegate(planner, "prefix-coder", {"issues.read": "direct"})
    register(world, coder.wire)
    shown = tree_jti(ok(tether(world, "agents", "--tree", cwd=tmp_path)), "prefix-coder")
    assert len(shown) >= 8 and coder.jti.startswith(shown)

    budgets = json.loads(ok(tether(world, "budgets", "--jti", shown, "--json", cwd=tmp_path)))
    assert budgets["links"][0]["jti"] == coder.jti
    out = ok(tether(world, "revoke", shown + "…", "--chain", str(planner.chain_path), "--key",
                    str(planner.key_path), cwd=tmp_path))  # copied with the ellipsis older listings printed
    assert f"revoked {coder.jti} (prefix-coder)" in out and "by principal:prefix-planner" in out

    verdict = tether(world, "grant", "verify", "--chain", str(coder.chain_path), "--trust",
                     f"{world.cp.signing_key_path}.pub", "--revoked", coder.jti[:10], cwd=tmp_path)
    assert verdict.returncode == 1 and "tether.chain_revoked" in verdict.stdout, verdict.stdout + verdict.stderr


def test_a_short_or_ambiguous_prefix_is_refused_with_a_code(world: World, tmp_path: Path) -> None:
    root_with_jti(world, "twin-a", "abcd1234" + os.urandom(12).hex())
    root_with_jti(world, "twin-b", "abcd1234" + os.urandom(12).hex())
    for command in (["revoke", "abcd1234"], ["budgets", "--jti", "abcd1234"]):
        message = refused(tether(world, *command, cwd=tmp_path), "tether.jti_ambiguous")
        assert "abcd1234" in message and "give more characters" in message
    too_short = refused(tether(world, "revoke", "abcd123", cwd=tmp_path), "tether.bad_request")
    assert "at least 8 hex characters" in too_short
    refused(tether(world, "revoke", "not-a-jti", cwd=tmp_path), "tether.bad_request")
    missing = refused(tether(world, "revoke", "0123456789", cwd=tmp_path), "tether.not_found")
    assert "0123456789" in missing
    agents = world.cp.client().request("GET", "/v1/agents")["agents"]
    assert not [a for a in agents if a["agent"].startswith("twin-") and a["status"] != "active"]  # nothing revoked


# -- revoke --agent as a principal ----------------------------------------------------------------------------
def test_revoke_agent_with_a_chain_acts_as_that_principal_never_as_the_admin(world: World, tmp_path: Path) -> None:
    lead = world.cp.issue("principal-lead", {"issues.read": "direct"})
    worker = world.cp.delegate(lead, "principal-worker", {"issues.read": "direct"})
    register(world, worker.wire)
    outsider = world.cp.issue("principal-outsider", {"issues.read": "direct"})
    register(world, outsider.wire)
    no_token = {"TETHER_ADMIN_TOKEN": "", "TETHER_TOKEN": ""}

    not_above = tether(world, "revoke", "--agent", "principal-worker", "--chain", str(outsider.chain_path), "--key",
                       str(outsider.key_path), cwd=tmp_path, env=no_token)
    assert "not an ancestor" in refused(not_above, "tether.forbidden")
    itself = tether(world, "revoke", "--agent", "principal-worker", "--chain", str(worker.chain_path), "--key",
                    str(worker.key_path), cwd=tmp_path)  # the admin token is in the environment: not used
    refused(itself, "tether.forbidden")

    done = json.loads(ok(tether(world, "revoke", "--agent", "principal-worker", "--chain", str(lead.chain_path),
                                "--key", str(lead.key_path), "--json", cwd=tmp_path, env=no_token)))
    assert [(r["jti"], r["by"], r["operator"]) for r in done["revoked"]] == [
        (worker.jti, "principal:principal-lead", None)]
    refused(tether(world, "revoke", "--agent", "principal-worker", "--key", str(lead.key_path), cwd=tmp_path),
            "tether.usage")


# -- usage, help, completion, colour -------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "usage"), [
    (["agents", "--bogus"], "usage: tether agents "),
    (["grant", "issue", "--agent", "x"], "usage: tether grant issue "),
    (["grant", "frob"], "usage: tether grant "),
    (["approvals", "show"], "usage: tether approvals "),
    (["revoke"], "usage: tether revoke "),
    (["records", "verify", "--nope"], "usage: tether records "),
])
def test_a_usage_error_prints_the_commands_usage_and_a_code(argv: list[str], usage: str, tmp_path: Path) -> None:
    out = tether(None, *argv, cwd=tmp_path, env={"TETHER_CONTROLPLANE": "http://127.0.0.1:9"})
    refused(out, "tether.usage")
    assert out.stderr.startswith(usage), out.stderr
    assert "usage: tether [-h]" not in out.stderr


def test_bash_completes_commands_actions_and_options_from_the_parser(tmp_path: Path) -> None:
    script = tmp_path / "tether.bash"
    script.write_text(ok(tether(None, "completion", "bash", cwd=tmp_path)))
    probe = tmp_path / "probe.sh"
    probe.write_text(f"""source {script}
comp() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); COMP_LINE="${{COMP_WORDS[*]}}"
  COMP_POINT=${{#COMP_LINE}}; COMPREPLY=(); _shtab_tether; echo "${{COMPREPLY[*]}}"; }}
comp tether appr
comp tether approvals ""
comp tether grant ""
comp tether revoke --ch
comp tether completion ""
""")
    lines = subprocess.run(["bash", str(probe)], capture_output=True, text=True, timeout=30).stdout.splitlines()
    grant_actions = " ".join(grant_parser_actions())  # what the parser has, whatever is added to it later
    assert lines == ["approvals", "list show approve deny", grant_actions, "--chain", "bash zsh tcsh"], lines
    assert {"issue", "delegate", "register", "verify"} <= set(grant_actions.split())
    zsh = ok(tether(None, "completion", "zsh", cwd=tmp_path))
    assert zsh.startswith("#compdef tether") and "revoke" in zsh


def grant_parser_actions() -> list[str]:
    import argparse

    from tether.cli.main import build_parser

    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    grant = next(a for a in top.choices["grant"]._actions if isinstance(a, argparse._SubParsersAction))
    return list(grant.choices)


def run_on_a_terminal(args: list[str], env: dict[str, str], timeout: float = 90,
                      interrupt_after: str | None = None) -> tuple[int, str]:
    """Run `tether ARGS` with a pseudo-terminal as stdout and stderr; what it wrote, as the terminal got it.
    ``interrupt_after``: send SIGINT (Ctrl-C) once this text has appeared."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns: room for a whole line
    proc = subprocess.Popen([PYTHON, "-m", "tether", *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
                if interrupt_after and interrupt_after.encode() in seen:
                    proc.send_signal(signal.SIGINT)
                    interrupt_after = None
        else:
            raise AssertionError(f"tether {' '.join(args)} did not finish: {seen.decode(errors='replace')[-2000:]}")
        return proc.wait(30), seen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_colour_only_on_a_terminal_and_never_with_no_color(world: World, tmp_path: Path) -> None:
    env = {**world.cp.env(), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    status, coloured = run_on_a_terminal(["records", "verify"], env)
    assert status == 0 and "\x1b[32mok\x1b[0m" in coloured, coloured
    status, plain = run_on_a_terminal(["records", "verify"], {**env, "NO_COLOR": "1"})
    assert status == 0 and "\x1b" not in plain and "ok: " in plain, plain
    piped = ok(tether(world, "records", "verify", cwd=tmp_path, env={"TERM": "xterm"}))
    assert "\x1b" not in piped


# -- --json and times ----------------------------------------------------------------------------------------
def test_every_listing_and_verdict_takes_json(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("json-agent", {"issues.read": "direct"})
    register(world, ident.wire)
    trust = f"{world.cp.signing_key_path}.pub"
    for argv in (["agents"], ["agents", "--tree"], ["budgets"], ["terminations"], ["approvals"], ["approvals", "--all"],
                 ["records"], ["records", "list"], ["operators", "list"], ["audit", "surface"],
                 ["grant", "verify", "--chain", str(ident.chain_path), "--controlplane", world.cp.url]):
        json.loads(ok(tether(world, *argv, "--json", cwd=tmp_path)))
    verdict = json.loads(ok(tether(world, "records", "verify", "--json", cwd=tmp_path)))
    assert verdict["ok"] is True and verdict["problems"] == [] and isinstance(verdict["records"], int)
    offline = json.loads(ok(tether(world, "grant", "verify", "--chain", str(ident.chain_path), "--trust", trust,
                                   "--json", cwd=tmp_path)))
    assert offline["valid"] is True and offline["agent"] == "json-agent" and offline["revocation_checked"] is False
    revoked = tether(world, "grant", "verify", "--chain", str(ident.chain_path), "--trust", trust, "--revoked",
                     ident.jti, "--json", cwd=tmp_path)
    assert revoked.returncode == 1
    assert json.loads(revoked.stdout)["error"]["code"] == "tether.chain_revoked"


def test_times_are_iso_8601_utc_never_epoch_seconds(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("time-agent", {"issues.read": "direct"})
    register(world, ident.wire)
    revoked = ok(tether(world, "revoke", "--agent", "time-agent", cwd=tmp_path))
    outputs = [revoked, ok(tether(world, "agents", cwd=tmp_path)), ok(tether(world, "agents", "--tree", cwd=tmp_path)),
               ok(tether(world, "grant", "verify", "--chain", str(ident.chain_path), "--trust",
                         f"{world.cp.signing_key_path}.pub", cwd=tmp_path))]
    assert ISO_UTC.search(revoked) and "time-agent" in revoked
    for text in outputs:
        assert ISO_UTC.search(text), text
        assert not EPOCH.search(text), text
        assert not re.search(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b", text), text  # no time without its zone


def test_the_agents_table_is_aligned(world: World, tmp_path: Path) -> None:
    for agent in ("t", "a-much-longer-agent-name-than-twenty"):
        register(world, world.cp.issue(agent, {"issues.read": "direct"}).wire)
    lines = ok(tether(world, "agents", cwd=tmp_path)).splitlines()
    header = lines[0]
    assert header.split()[:6] == ["AGENT", "STATUS", "JTI", "SIDECAR", "EXPIRES", "CAPABILITIES"]
    for column in ("STATUS", "JTI", "EXPIRES"):
        start = header.index(column)
        for line in lines[1:]:
            assert line[start - 2:start] == "  " and line[start] != " ", (column, line)


# -- terminate --wait ------------------------------------------------------------------------------------------
def in_flight_through(world: World, agent: str, seconds: float) -> tuple[object, object]:
    """A sidecar for ``agent`` with one call to /slow in flight, and the thread making it."""
    import threading

    import requests

    sidecar = world.sidecar(world.cp.issue(agent, {"slow.read": "direct"}))

    def call() -> None:
        try:
            requests.get(f"{world.tools.base}/slow?s={seconds:g}", proxies=sidecar.proxies(), timeout=120)
        except requests.RequestException:
            pass  # cut by the termination: what the record says of it is the test's business, not this thread's

    thread = threading.Thread(target=call, daemon=True)
    thread.start()

    def listed() -> bool:
        runs = [a["sidecar"] for a in world.cp.client().request("GET", "/v1/agents")["agents"] if a["agent"] == agent]
        return bool(runs and runs[0] and runs[0]["inflight"] == 1)

    wait_until(listed, 30, what=f"{agent}'s call in flight, as the control plane sees it")
    return sidecar, thread


def test_terminate_wait_says_how_it_goes_in_plain_lines_off_a_terminal(world: World, tmp_path: Path) -> None:
    in_flight_through(world, "progress-plain", 4)
    out = tether(world, "terminate", "progress-plain", "--window", "20", "--wait", cwd=tmp_path)
    assert out.returncode == 0, out.stderr + out.stdout
    lines = out.stderr.splitlines()
    assert "\r" not in out.stderr
    assert re.fullmatch(r"termination term-\S+: drain of progress-plain and 0 descendant\(s\), window 20s", lines[0])
    assert re.fullmatch(r"  draining: 0/1 agents acknowledged, 1 call\(s\) in flight, \d+s left in the 20s window",
                        lines[1]), lines
    assert lines[-1] == "  terminated: 1/1 agents acknowledged", lines
    assert "record rec-" in out.stdout and "drain of progress-plain" in out.stdout


def test_terminate_wait_on_a_terminal_rewrites_one_line_and_ctrl_c_says_the_termination_goes_on(
        world: World, tmp_path: Path) -> None:
    in_flight_through(world, "progress-tty", 60)
    status, seen = run_on_a_terminal(["terminate", "progress-tty", "--window", "30", "--wait"],
                                     {**world.cp.env(), "TERM": "xterm"}, interrupt_after="left in the 30s window")
    assert status == 130, seen
    assert "\r" in seen and "1 call(s) in flight" in seen
    tid = re.search(r"termination (term-\S+): drain of progress-tty", seen)
    assert tid is not None, seen
    assert f"termination {tid.group(1)} continues on the control plane" in seen
    assert f"tether terminations {tid.group(1)}" in seen and "Traceback" not in seen
    doc = world.cp.client().request("GET", f"/v1/terminations/{tid.group(1)}")
    assert doc["state"] in ("draining", "reconciling", "terminated")  # it went on without its follower


def test_an_agent_that_never_ran_a_sidecar_is_terminated_without_waiting_out_the_window(
        world: World, tmp_path: Path) -> None:
    """Nothing can acknowledge for it, and nothing of it can be in flight: the record says it is unaccounted as soon
    as the termination has revoked it, not after the 120 s window and the grace."""
    ghost = world.cp.issue("never-ran", {"slow.read": "direct"})
    register(world, ghost.wire)
    out = tether(world, "terminate", "never-ran", "--window", "120", "--wait", cwd=tmp_path, timeout=60)
    assert out.returncode == 1, out.stderr + out.stdout  # exit 1: an agent the record could not account for
    assert "UNACCOUNTED" in out.stdout and "never-ran" in out.stdout
    assert "never ran a sidecar: never-ran" in out.stderr


# -- the control plane's own start -------------------------------------------------------------------------------
def test_serve_refuses_a_bad_catalog_before_making_up_an_admin_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TETHER_ADMIN_TOKEN", "TETHER_TOKEN")}
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "broken.yaml").write_text("capabilities:\n  x: {http: [\n")
    for name, phrase in (("empty.yaml", "the catalog is empty"), ("broken.yaml", "line 3, column 1: not valid YAML")):
        out = subprocess.run([PYTHON, "-m", "tether", "controlplane", "serve", "--catalog", name, "--store",
                              f"sqlite:///{tmp_path / 'cp.db'}", "--listen", "127.0.0.1:0"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"error: tether.catalog_invalid: {name}: " in out.stderr, out.stderr
        assert phrase in out.stderr and "<unicode string>" not in out.stderr and "NoneType" not in out.stderr
        assert "TETHER_ADMIN_TOKEN" not in out.stderr and not (tmp_path / "tether-signing.key").exists()


def test_a_sidecar_waiting_for_its_control_plane_speaks_in_one_voice(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("one-voice", {"issues.read": "direct"})
    log = tmp_path / "sidecar.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PYTHON, "-m", "tether", "sidecar", "--controlplane", "http://127.0.0.1:9", "--chain",
                                 str(ident.chain_path), "--key", str(ident.key_path), "--listen", "127.0.0.1:0",
                                 "--state-dir", str(tmp_path / "state")], stdout=out, stderr=out,
                                env={**world.cp.env(), "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: "tether: waiting for the control plane at http://127.0.0.1:9" in log.read_text(), 60,
                   what="the sidecar's status line")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    text = log.read_text()
    assert text.startswith("tether: waiting for the control plane"), text
    assert " WARNING " not in text and "Traceback" not in text


def test_a_json_file_that_is_not_what_it_should_be_is_a_coded_error(world: World, tmp_path: Path) -> None:
    (tmp_path / "cut.json").write_text("[1,")
    (tmp_path / "object.json").write_text("{}")
    trust = f"{world.cp.signing_key_path}.pub"
    assert "is not JSON" in refused(tether(None, "records", "verify", "--file", "cut.json", "--trust", trust,
                                           cwd=tmp_path), "tether.bad_request")
    assert "expected a list" in refused(tether(None, "records", "verify", "--file", "object.json", "--trust", trust,
                                               cwd=tmp_path), "tether.bad_request")
    refused(tether(None, "records", "verify-one", "cut.json", "--proof", "object.json", "--checkpoint", "object.json",
                   "--trust", trust, cwd=tmp_path), "tether.bad_request")
