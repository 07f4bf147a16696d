"""`tether demo` tells the whole story and leaves nothing running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from tether.controlplane.termination import terminated_agents

from .harness import PYTHON


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_demo_runs_end_to_end_twice_in_one_dir(tmp_path: Path) -> None:
    """The second run re-grants every id the first one terminated: each new link starts clean."""
    for _ in range(2):
        demo_once(tmp_path)


def demo_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    result = subprocess.run([PYTHON, "-m", "tether", "demo", "--fast", "--dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for step in ("Issue the root agent's grant", "A call waits for a person", "The delegation tree",
                 "Revoke one branch", "Terminate the root with a drain", "The reconciliation record"):
        assert step in out
    assert "tether.capability_absent" in out          # the absent capability
    assert "drop_database" not in out.split("MCP server offers me these tools:")[1].splitlines()[0]
    assert "tether.chain_revoked" in out              # the revoked branch
    record = json.loads((tmp_path / "record.json").read_text())
    assert sorted(terminated_agents(record)) == ["researcher", "root", "summarizer", "writer"]
    assert record["agents_unaccounted"] == []
    resolutions = {c["resolution"] for c in record["calls"]}
    assert {"completed", "refused"} <= resolutions
    assert all(lease.get("revoked_at") for lease in record["leases"])
    assert record["requested_by"] == "rita" and record["operator"] == {"operator": "rita", "via": "token"}
    assert "requested by rita" in out and "tether operators add alice --role approver" in out
    har = json.loads((tmp_path / "captures.har").read_text())
    assert_har_lines_up_with(record, har)
    assert "demo-tool-secret" not in (tmp_path / "captures.har").read_text()  # Authorization redacted
    pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "agents").glob("*/sidecar.ready")]
    assert len(pids) == 4 and not [pid for pid in pids if alive(pid)]


def assert_har_lines_up_with(record: dict, har: dict) -> None:
    """The demo's HAR is `tether capture export --termination`'s: one entry per call of the record, in time
    order, each entry's `_tether` naming that call, and a cut call's entry saying what the record says."""
    entries = har["log"]["entries"]
    calls = {c["call_id"]: c for c in record["calls"]}
    assert sorted(e["_tether"]["call_id"] for e in entries) == sorted(
        c["call_id"] for c in record["calls"] if c.get("capture_ref"))
    started = [e["startedDateTime"] for e in entries]
    assert started == sorted(started)
    for entry in entries:
        mark, call = entry["_tether"], calls[entry["_tether"]["call_id"]]
        assert (mark["agent"], mark["capability"], mark["resolution"], mark["capture_ref"]) == (
            call["agent"], call["capability"], call["resolution"], call["capture_ref"]), (mark, call)
        assert entry["request"]["method"] == call["method"]
        assert entry["request"]["url"].split("?")[0] == call["url"]
        response = entry["response"]
        if call["resolution"] == "completed":
            assert response["status"] == call["status"]
        elif call["resolution"] == "refused":  # tether's refusal, as the agent got it
            headers = {h["name"].lower(): h["value"] for h in response["headers"]}
            assert headers.get("tether-error") == call["code"], (entry, call)
        else:  # no answer came back: the entry says what the record says, not what the socket last said
            assert response["_error"] == entry["comment"] == f"tether: {call['resolution']} ({call['code']})"
            assert response["content"]["size"] == 0


def test_example_tools_name_the_flag_when_the_address_is_taken() -> None:
    """`tether example tools` on a port someone holds: one line with the code and the flag to change, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run([PYTHON, "-m", "tether", "example", "tools", "--http", f"127.0.0.1:{port}",
                                 "--mcp", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: tether.listen_failed: ") and "--http" in result.stderr
    assert "Traceback" not in result.stderr
