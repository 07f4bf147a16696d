"""The command blocks of docs/quickstart.md and the README, run in order as a reader would run them.

The convention (what a document's author writes):

- A fenced block is **runnable** when the line before its opening fence is ``<!-- doc-test: run -->``. Its
  commands run in one shell per document, block after block in document order, so what one block exports,
  writes or starts in the background is there for the next, as in a reader's terminal. Add
  ``expect=WORD`` (repeatable, no spaces) to say what the block's output must contain: say key facts (a stable
  code such as ``tether.capability_absent``, a name, a file), not wording others may change.
- ``<!-- doc-test: skip (why) -->`` marks a block a reader runs but the suite cannot (installing into the
  venv the suite already runs in). Every ``sh`` block of docs/quickstart.md is one or the other.
- Any other block is **illustrative** (a template with placeholders, a YAML fragment, output): not run. In the
  README, every ``tether ...`` line of an unmarked ``sh`` block is still parsed by the real CLI parser, so a
  renamed command or flag shows up here even where the block cannot run.

How the blocks run: a real ``bash`` (no rc files) in a fresh temporary directory, with the venv's ``tether`` and
``python`` first on ``PATH``, no ``TETHER_*`` variables from outside, ``HOME`` and ``XDG_STATE_HOME`` inside the
directory. Each block is written to a file and ``source``d with stdin from ``/dev/null`` (so no command reads the
next block as its input); every command that exits non-zero is a failure (an ``ERR`` trap reports it), and a
block must end within ``BLOCK_TIMEOUT_S``. The one change made to a block: the well-known ports it names
(7000 for the control plane, 7101 and 7102 for ``tether example tools``) become free ones, the same everywhere
in the document, so the test never collides with anything on the machine. Whatever a document starts is
stopped at the end (its own last block should stop it; the test then ends the shell's process group and every
sidecar left in the state directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tether.capability.chain import parse_chain_unverified
from tether.capability.shared import read_chain

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
BLOCK_TIMEOUT_S = 150.0
WELL_KNOWN_PORTS = ("7000", "7101", "7102")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<body>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
END = "__DOC_TEST_BLOCK_END__"
FAILED = "__DOC_TEST_FAILED__"


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mode: str  # "run", "skip" or "" (illustrative)
    expect: list[str] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the doc-test marker on the line before it (if any)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, start = opening["fence"], i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mode, expect = "", []
        marker = MARKER.match(prev)
        if marker:
            words = marker["body"].split()
            mode = words[0] if words else ""
            assert mode in ("run", "skip"), f"{path.name}:{start + 1}: unknown doc-test marker {prev!r}"
            expect = [w.removeprefix("expect=") for w in words[1:] if w.startswith("expect=")]
        found.append(Block(path.name, start + 1, opening["lang"], "\n".join(body) + "\n", mode, expect))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_free_ports(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"(?<![\d.])(" + "|".join(ports) + r")(?!\d)", lambda m: ports[m[1]], text)


class Shell:
    """One bash for one document: blocks are sourced into it in order, their output collected per block."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        home = workdir / ".home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HOME=str(home),
                   XDG_STATE_HOME=str(workdir / ".state"), VIRTUAL_ENV=str(BIN.parent), NO_COLOR="1",
                   PYTHONUNBUFFERED="1")
        env.pop("PYTHONHOME", None)
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=workdir, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send("set -o pipefail\n"
                   f"trap 'echo \"{FAILED} exit $? from: $BASH_COMMAND\"' ERR\n")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def run(self, block: Block, text: str, number: int) -> str:
        script = self.workdir / f".block-{number:02d}.sh"
        script.write_text(text)
        self._send(f"source {shlex.quote(str(script))} < /dev/null\necho {END}-{number}\n")
        out: list[str] = []
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{block.where()}: still running after {BLOCK_TIMEOUT_S:g}s; output so "
                                     f"far:\n{''.join(out)[-4000:]}") from None
            if line is None:
                raise AssertionError(f"{block.where()}: the shell ended; output:\n{''.join(out)[-4000:]}")
            if line.rstrip("\n").endswith(f"{END}-{number}"):  # a block's last line may lack its newline
                out.append(line.rstrip("\n").removesuffix(f"{END}-{number}"))
                return "".join(out)
            out.append(line)

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self._send("exit\n")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        stop_group(self.proc.pid)
        for ready in (self.workdir / ".state").glob("tether/*/sidecar.ready"):  # sidecars run in sessions of their own
            with contextlib.suppress(ValueError, OSError, KeyError):
                stop_group(int(json.loads(ready.read_text())["pid"]))


def stop_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


@contextlib.contextmanager
def shell(workdir: Path) -> Iterator[Shell]:
    sh = Shell(workdir)
    try:
        yield sh
    finally:
        sh.close()


def run_document(path: Path, workdir: Path) -> list[tuple[Block, str]]:
    """Every runnable block of ``path``, in order, in one shell; returns each block with its output."""
    ports = {p: str(free_port()) for p in WELL_KNOWN_PORTS}
    runnable = [b for b in blocks_of(path) if b.mode == "run"]
    assert runnable, f"{path.name} has no runnable blocks"
    done: list[tuple[Block, str]] = []
    with shell(workdir) as sh:
        for number, block in enumerate(runnable, 1):
            out = sh.run(block, with_free_ports(block.text, ports), number)
            if "tether.isolation_unavailable" in out:
                pytest.skip(f"{block.where()}: tether run cannot enforce on this machine: {out.strip()[-300:]}")
            failed = [line for line in out.splitlines() if line.startswith(FAILED)]
            assert not failed, f"{block.where()}: {failed[0].removeprefix(FAILED).strip()}\n{block.text}\n" \
                               f"output:\n{out[-4000:]}"
            missing = [word for word in block.expect if word not in out]
            assert not missing, f"{block.where()}: output lacks {missing}\n{block.text}\noutput:\n{out[-4000:]}"
            done.append((block, out))
    return done


# -- the quickstart --------------------------------------------------------------------------------------------
def test_every_shell_block_of_the_quickstart_is_run_or_says_why_not() -> None:
    unmarked = [b.where() for b in blocks_of(QUICKSTART) if b.lang == "sh" and not b.mode]
    assert not unmarked, f"sh blocks with no doc-test marker (run, or skip with a reason): {unmarked}"


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    """From nothing to an allowed call, a refused one, an approval, a revocation and a verified record."""
    outputs = run_document(QUICKSTART, tmp_path)
    text = "".join(out for _, out in outputs)
    # What the reader was promised, checked on what the commands left behind, not on their wording.
    tools_log = (tmp_path / "tools.log").read_text()
    assert "ticket API: GET /tickets" in tools_log and "ticket API: POST /tickets" in tools_log  # allowed, approved
    assert "ticket API: DELETE" not in tools_log and "MCP server: drop_database" not in tools_log  # never arrived
    assert "MCP server: lookup" in tools_log
    assert "tools the agent sees: lookup\n" in text  # drop_database and send_email are absent from tools/list
    assert json.loads((tmp_path / "ticket.json").read_text())["title"] == "printer on fire"
    heard = next(out for block, out in outputs if "tether grant proof" in block.text)
    leaf_jti = parse_chain_unverified(read_chain(str(tmp_path / "agent.chain")))[-1].jti
    assert json.loads(heard)["revoked"] == [leaf_jti]  # the event stream, read with a proof the CLI minted
    har = json.loads((tmp_path / "helpdesk.har").read_text())
    assert {e["_tether"]["agent"] for e in har["log"]["entries"]} == {"helpdesk"}
    assert {"refused", "completed"} <= {e["_tether"]["resolution"] for e in har["log"]["entries"]}


# -- the README ------------------------------------------------------------------------------------------------
def test_the_readme_walk_through_runs_as_written(tmp_path: Path) -> None:
    outputs = run_document(README, tmp_path)
    assert (tmp_path / "coder.chain").exists() and (tmp_path / "planner.chain").exists()
    budgets = next(out for block, out in outputs if "tether budgets" in block.text)
    # the tightest budget in the chain, fetcher's 4 calls, holds
    assert re.findall(r"status=(\d+)", budgets) == ["200"] * 4 + ["429"] * 2


def tether_lines(block: Block) -> Iterator[list[str]]:
    """The ``tether ...`` commands of a block as argv lists: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    for raw in joined.splitlines():
        line = raw.strip()
        for piece in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
            piece = piece.strip().rstrip("&").strip()
            try:
                words = shlex.split(piece, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value tether ...
                words = words[1:]
            if words[:1] == ["sudo"]:
                words = words[1:]
            redirect = next((i for i, w in enumerate(words) if re.match(r"^\d?[<>]", w)), len(words))
            words = words[:redirect]
            # "..." and "[--flag VALUE]" are a template's placeholders, not something to parse
            if len(words) >= 2 and words[0] == "tether" and "..." not in piece and "[-" not in piece:
                yield words[1:]


def test_the_readmes_other_tether_commands_parse() -> None:
    """Blocks that cannot run (placeholders, other machines) still name commands and flags that exist."""
    from tether.cli.main import build_parser

    checked, wrong = 0, []
    for block in blocks_of(README):
        if block.mode or block.lang != "sh":
            continue
        for argv in tether_lines(block):
            checked += 1
            try:
                with contextlib.redirect_stderr(open(os.devnull, "w")):
                    build_parser().parse_args(argv)
            except SystemExit as exc:
                if exc.code:
                    wrong.append(f"{block.where()}: tether {shlex.join(argv)}")
    assert checked >= 20
    assert not wrong, "README commands the CLI does not accept:\n" + "\n".join(wrong)
