"""The release gate for MCP items beyond tools: resources, prompts and plumbing on the audit surface and in
``tether audit diff``. The comparison (``capability.mcpwire``) is tested as a table; the CLI rows run it on
files, from catalogs, as a release gate would."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tether.capability import mcpwire
from tether.capability.catalog import parse_catalog
from tether.capability.glob import admits
from tether.capability.jsonpieces import canonical_json
from tether.cli.main import main
from tether.controlplane import audit

URL = "http://tools:9000/mcp"


def w(**item: object) -> dict[str, object]:
    return {"url": URL, **item}


# (case, old wire, new wire, widening kinds expected)
WIRES = [
    ("resource glob widened", w(resource="docs://public/*"), w(resource="docs://*"), [mcpwire.MCP_RESOURCE]),
    ("resource to a sibling", w(resource="docs://public/*"), w(resource="docs://private/*"), [mcpwire.MCP_RESOURCE]),
    ("one resource to a glob", w(resource="docs://a"), w(resource="docs://*"), [mcpwire.MCP_RESOURCE]),
    ("template widened", w(resource="users://{id}/profile"), w(resource="users://{id}"), [mcpwire.MCP_RESOURCE]),
    ("resource narrowed", w(resource="docs://*"), w(resource="docs://public/*"), []),
    ("template respelt as a glob", w(resource="users://{id}/profile"), w(resource="users://*/profile"), []),
    ("glob respelt as a template", w(resource="users://*/profile"), w(resource="users://{user}/profile"), []),
    ("resource unchanged", w(resource="docs://a"), w(resource="docs://a"), []),
    ("prompt changed", w(prompt="greet"), w(prompt="leak"), [mcpwire.MCP_PROMPT]),
    ("prompt unchanged", w(prompt="greet"), w(prompt="greet"), []),
    ("tool changed", w(tool="add"), w(tool="delete"), [mcpwire.MCP_TOOL]),
    ("tool became a resource", w(tool="add"), w(resource="docs://*"), [mcpwire.MCP_ITEM]),
    ("logging became completion", w(logging=True), w(completion=True), [mcpwire.MCP_ITEM]),
    ("plumbing unchanged", w(subscriptions=True), w(subscriptions=True), []),
    ("url changed", w(prompt="greet"), {"url": "http://other:9000/mcp", "prompt": "greet"}, [mcpwire.MCP_URL]),
    ("url respelt", w(logging=True), {"url": "http://TOOLS:9000/mcp/", "logging": True}, []),
]


@pytest.mark.parametrize(("case", "old", "new", "expected"), WIRES, ids=[c[0] for c in WIRES])
def test_mcp_wire_widenings(case: str, old: dict, new: dict, expected: list[str]) -> None:
    assert mcpwire.kind_of(old) is not None and mcpwire.kind_of(new) is not None
    found = mcpwire.widenings(old, new)
    assert [kind for kind, *_ in found] == expected, found
    for kind, _, _, detail in found:
        if kind == mcpwire.MCP_RESOURCE:
            witness = detail.split("admits ", 1)[1].split(", which", 1)[0].strip("'")
            old_glob, new_glob = (x["resource"].replace("{id}", "*") for x in (old, new))
            assert admits(new_glob, witness) and not admits(old_glob, witness), detail


@pytest.mark.parametrize("wire", [w(), w(tool=""), w(logging=False), w(logging="yes"), w(tool="a", prompt="b"),
                                  {"tool": "a"}, w(tool="a", extra=1), w(resource=3)])
def test_unreadable_mcp_wires(wire: dict) -> None:
    assert mcpwire.kind_of(wire) is None


def test_surface_text_names_each_kind() -> None:
    assert mcpwire.text(w(tool="add")) == f"mcp {URL} tool add"
    assert mcpwire.text(w(resource="docs://*")) == f"mcp {URL} resource docs://*"
    assert mcpwire.text(w(logging=True)) == f"mcp {URL} logging"


# -- through the CLI, from catalogs --------------------------------------------------------------------------
needs_gate = pytest.mark.skipif(not hasattr(audit, "mcpwire"), reason=(
    "tether/controlplane/audit.py does not read MCP items beyond tools yet (it must delegate its mcp wire to "
    "tether.capability.mcpwire)"))

BASE = {
    "add": {"mcp": {"url": URL, "tool": "add"}},
    "docs": {"mcp": {"url": URL, "resource": "docs://public/*"}},
    "profile": {"mcp": {"url": URL, "resource": "users://{id}/profile"}},
    "greet": {"mcp": {"url": URL, "prompt": "greet"}},
    "log": {"mcp": {"url": URL, "logging": True}},
}
GRANTS = {"add": "direct", "docs": "direct", "profile": "approval", "greet": "direct", "log": "direct"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def surface_file(capsys: pytest.CaptureFixture[str], d: Path, name: str, caps: dict, grants: dict) -> Path:
    (d / f"{name}.yaml").write_text(json.dumps({"capabilities": caps, "roles": {"bot": grants}}))
    code, out, err = run_cli(capsys, "audit", "surface", "--catalog", str(d / f"{name}.yaml"), "--role", "bot=bot",
                             "--json")
    assert code == 0, err
    (d / f"{name}.json").write_text(out)
    return d / f"{name}.json"


def test_tool_catalogs_keep_their_hash_and_wire() -> None:
    """A catalog of tools only hashes and shows as it always did: every existing grant stays valid."""
    catalog = parse_catalog(f"capabilities:\n  add: {{mcp: {{url: '{URL}', tool: add}}}}\n")
    assert catalog.capabilities["add"].mcp.to_dict() == {"url": URL, "tool": "add"}
    canonical = canonical_json({"capabilities": {"add": {"mcp": {"url": URL, "tool": "add"}}}, "roles": {}})
    assert catalog.hash == "sha256:" + hashlib.sha256(canonical).hexdigest()


@needs_gate
def test_the_surface_shows_every_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(surface_file(capsys, tmp_path, "s", BASE, GRANTS).read_text())
    assert doc["agents"]["bot"]["docs"] == {"tier": "direct", "wire": {"mcp": {"url": URL,
                                            "resource": "docs://public/*"}}, "budget": None}
    assert doc["agents"]["bot"]["log"]["wire"] == {"mcp": {"url": URL, "logging": True}}
    (tmp_path / "s.yaml").write_text(json.dumps({"capabilities": BASE, "roles": {"bot": GRANTS}}))
    code, text, _ = run_cli(capsys, "audit", "surface", "--catalog", str(tmp_path / "s.yaml"), "--role", "bot=bot")
    assert code == 0
    assert f"mcp {URL} resource users://{{id}}/profile" in text and f"mcp {URL} prompt greet" in text
    assert f"mcp {URL} logging" in text


def changed(name: str, **item: object) -> dict:
    caps = json.loads(json.dumps(BASE))
    caps[name]["mcp"] = {"url": URL, **item}
    return caps


GATE = [
    ("resource widened", changed("docs", resource="docs://*"), GRANTS, [("docs", mcpwire.MCP_RESOURCE)]),
    ("resource narrowed", changed("docs", resource="docs://public/a"), GRANTS, []),
    ("prompt changed", changed("greet", prompt="leak_secrets"), GRANTS, [("greet", mcpwire.MCP_PROMPT)]),
    ("plumbing kind changed", changed("log", completion=True), GRANTS, [("log", mcpwire.MCP_ITEM)]),
    ("resource tier raised", BASE, {**GRANTS, "profile": "direct"}, [("profile", audit.TIER)]),
    ("subscriptions added", {**BASE, "subs": {"mcp": {"url": URL, "subscriptions": True}}},
     {**GRANTS, "subs": "direct"}, [("subs", audit.CAPABILITY_ADDED)]),
    ("template respelt", changed("profile", resource="users://*/profile"), GRANTS, []),
]


@needs_gate
@pytest.mark.parametrize(("case", "caps", "grants", "expected"), GATE, ids=[g[0] for g in GATE])
def test_the_gate_on_mcp_items(case: str, caps: dict, grants: dict, expected: list, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    old = surface_file(capsys, tmp_path, "old", BASE, GRANTS)
    new = surface_file(capsys, tmp_path, "new", caps, grants)
    code, out, _ = run_cli(capsys, "audit", "diff", str(old), str(new), "--json")
    found = sorted((x["capability"], x["kind"]) for x in json.loads(out)["widenings"])
    assert found == sorted(expected), out
    assert code == (1 if expected else 0)
