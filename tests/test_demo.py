"""`tether demo` tells the whole story and leaves nothing running."""

from __future__ import annotations

import json
import os
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
    assert har["log"]["entries"]
    assert "demo-tool-secret" not in (tmp_path / "captures.har").read_text()  # Authorization redacted
    pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "agents").glob("*/sidecar.ready")]
    assert len(pids) == 4 and not [pid for pid in pids if alive(pid)]
