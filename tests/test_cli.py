"""The CLI as a user runs it (real subprocesses against a real control plane)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability.chain import parse_chain_unverified

from .harness import PYTHON, ControlPlaneProcess, prepare_controlplane


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("cli"), 1, 2, 3).start()
    try:
        yield proc
    finally:
        proc.stop()


def tether(cp: ControlPlaneProcess, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tether", *args], cwd=cwd, env=cp.env(), capture_output=True,
                          text=True, timeout=60)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def test_the_readme_flow_issue_delegate_tree_revoke_verify(cp: ControlPlaneProcess, tmp_path: Path) -> None:
    """keygen, root grant, two delegations, the tree, revoking the middle link as its parent principal,
    and the leaf's verification failing with `revoked`."""
    for name in ("a", "b", "c"):
        ok(tether(cp, "keygen", "--out", f"{name}.key", cwd=tmp_path))
        assert (tmp_path / f"{name}.key").stat().st_mode & 0o777 == 0o600
    ok(tether(cp, "grant", "issue", "--signing-key", str(cp.signing_key_path), "--catalog", str(cp.catalog_path),
              "--agent", "planner", "--subject-key", "a.key.pub", "--role", "reader", "--out", "a.chain", cwd=tmp_path))
    ok(tether(cp, "grant", "register", "--chain", "a.chain", "--key", "a.key", cwd=tmp_path))
    ok(tether(cp, "grant", "delegate", "--chain", "a.chain", "--key", "a.key", "--agent", "coder",
              "--subject-key", "b.key.pub", "--cap", "issues.read=direct", "--out", "b.chain", cwd=tmp_path))
    ok(tether(cp, "grant", "register", "--chain", "b.chain", "--key", "b.key", cwd=tmp_path))
    ok(tether(cp, "grant", "delegate", "--chain", "b.chain", "--key", "b.key", "--agent", "tester",
              "--subject-key", "c.key.pub", "--cap", "issues.read=approval", "--out", "c.chain", cwd=tmp_path))
    ok(tether(cp, "grant", "register", "--chain", "c.chain", "--key", "c.key", cwd=tmp_path))

    tree = ok(tether(cp, "agents", "--tree", cwd=tmp_path)).splitlines()
    lines = [line for line in tree if any(a in line for a in ("planner", "coder", "tester"))]
    assert lines[0].startswith("planner") and "└── coder" in lines[1] and "└── tester" in lines[2]

    assert "valid" in ok(tether(cp, "grant", "verify", "--chain", "c.chain", "--controlplane", cp.url, cwd=tmp_path))
    middle = parse_chain_unverified((tmp_path / "b.chain").read_text().strip())[-1].jti

    as_itself = tether(cp, "revoke", middle, "--chain", "b.chain", "--key", "b.key", cwd=tmp_path)
    assert as_itself.returncode == 2 and "tether.forbidden" in as_itself.stderr
    out = ok(tether(cp, "revoke", middle, "--chain", "a.chain", "--key", "a.key", cwd=tmp_path))
    assert "principal:planner" in out and "tester" in out

    verdict = tether(cp, "grant", "verify", "--chain", "c.chain", "--controlplane", cp.url, cwd=tmp_path)
    assert verdict.returncode == 1
    assert "tether.chain_revoked" in verdict.stdout and "(revoked)" in verdict.stdout
    offline = tether(cp, "grant", "verify", "--chain", "c.chain", "--trust", f"{cp.signing_key_path}.pub",
                     "--revoked", middle, cwd=tmp_path)
    assert offline.returncode == 1 and "tether.chain_revoked" in offline.stdout
    assert "REVOKED" in ok(tether(cp, "agents", "--tree", cwd=tmp_path))


def test_delegation_cannot_widen(cp: ControlPlaneProcess, tmp_path: Path) -> None:
    ok(tether(cp, "keygen", "--out", "p.key", cwd=tmp_path))
    ok(tether(cp, "keygen", "--out", "q.key", cwd=tmp_path))
    ok(tether(cp, "grant", "issue", "--signing-key", str(cp.signing_key_path), "--catalog", str(cp.catalog_path),
              "--agent", "narrow", "--subject-key", "p.key.pub", "--cap", "issues.read=approval", "--out", "p.chain",
              cwd=tmp_path))
    for cap, reason in (("issues.write=direct", "widened_capability"), ("issues.read=direct", "tier_weakened")):
        result = tether(cp, "grant", "delegate", "--chain", "p.chain", "--key", "p.key", "--agent", "w",
                        "--subject-key", "q.key.pub", "--cap", cap, cwd=tmp_path)
        assert result.returncode == 2 and "tether.chain_invalid" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert reason in result.stderr or cap.split("=")[0] in result.stderr


def test_audit_surface_and_diff_gate(cp: ControlPlaneProcess, tmp_path: Path) -> None:
    ok(tether(cp, "keygen", "--out", "s.key", cwd=tmp_path))
    ok(tether(cp, "grant", "issue", "--agent", "auditee", "--subject-key", "s.key.pub", "--cap", "issues.read=approval",
              "--out", "s.chain", cwd=tmp_path))  # through the control plane (admin), registered on issue
    old = json.loads(ok(tether(cp, "audit", "surface", "--json", cwd=tmp_path)))
    assert old["version"] == 2
    assert old["agents"]["auditee"]["issues.read"]["tier"] == "approval"
    assert old["agents"]["auditee"]["mcp.delete"]["tier"] == "absent"
    (tmp_path / "old.json").write_text(json.dumps(old))

    wider = json.loads(json.dumps(old))
    wider["agents"]["auditee"]["issues.read"]["tier"] = "direct"
    wider["agents"]["auditee"]["mcp.delete"]["tier"] = "approval"
    (tmp_path / "wider.json").write_text(json.dumps(wider))
    gate = tether(cp, "audit", "diff", "old.json", "wider.json", cwd=tmp_path)
    assert gate.returncode == 1
    assert "auditee: issues.read approval -> direct" in gate.stdout
    assert "auditee: mcp.delete absent -> approval" in gate.stdout

    narrower = json.loads(json.dumps(old))
    narrower["agents"]["auditee"]["issues.read"]["tier"] = "absent"
    (tmp_path / "narrow.json").write_text(json.dumps(narrower))
    assert tether(cp, "audit", "diff", "old.json", "narrow.json", cwd=tmp_path).returncode == 0
    (tmp_path / "junk.json").write_text("[1, 2")
    junk = tether(cp, "audit", "diff", "old.json", "junk.json", cwd=tmp_path)
    assert junk.returncode == 2 and "tether.bad_request" in junk.stderr


def test_bad_catalog_is_a_clear_error(cp: ControlPlaneProcess, tmp_path: Path) -> None:
    (tmp_path / "typo.yaml").write_text("capabilities:\n  x.read: {http: {host: a.example, methds: [GET], path: /}}\n")
    ok(tether(cp, "keygen", "--out", "k.key", cwd=tmp_path))
    result = tether(cp, "grant", "issue", "--signing-key", str(cp.signing_key_path), "--catalog", "typo.yaml",
                    "--agent", "x", "--subject-key", "k.key.pub", "--cap", "x.read=direct", cwd=tmp_path)
    assert result.returncode == 2
    assert "tether.catalog_invalid" in result.stderr and "typo.yaml" in result.stderr
    assert "x.read" in result.stderr and "methds" in result.stderr
    serve = subprocess.run([PYTHON, "-m", "tether", "controlplane", "serve", "--catalog", "typo.yaml",
                            "--listen", "127.0.0.1:1"], cwd=tmp_path, env=cp.env(), capture_output=True, text=True,
                           timeout=30)
    assert serve.returncode == 2 and "tether.catalog_invalid" in serve.stderr
