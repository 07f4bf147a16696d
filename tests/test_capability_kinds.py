"""The capability kinds sit behind one protocol in one registry (tether/capability/kinds/), and the catalog's
loader, the audit surface and its diff ask the registry rather than naming a kind. Pure: no sockets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tether.capability.catalog import catalog_from, parse_catalog
from tether.capability.glob import Budget
from tether.capability.kinds import KINDS, CapabilityKind, match_of
from tether.controlplane import audit

ROOT = Path(__file__).resolve().parent.parent / "tether"
CATALOG = """
credentials:
  tok: {header: Authorization, format: "Bearer {secret}", insecure_plain_http: loopback}
capabilities:
  web.read: {http: {host: Api.Example.com, methods: [GET], path: "/v1/*", scheme: https, port: 443}}
  web.any: {http: {host: api.example.com, methods: [GET, POST], path: "/*"}}
  tools.search: {mcp: {url: "http://127.0.0.1:9000/mcp", tool: search}, credential: tok}
  tools.docs: {mcp: {url: "http://127.0.0.1:9000/mcp", resource: "docs://*"}, credential: tok}
roles:
  reader: {web.read: direct, tools.search: approval}
"""


def test_the_registry_holds_http_and_mcp_each_behind_the_protocol() -> None:
    assert list(KINDS) == ["http", "mcp"]
    for name, kind in KINDS.items():
        assert isinstance(kind, CapabilityKind) and kind.name == name


def test_every_capability_has_one_kind_and_its_answers_are_the_catalogs() -> None:
    """The loader built each capability through its kind; writing the catalog back through the kinds gives the
    same catalog (the hash every grant names is over this form), and each route is its kind's."""
    catalog = parse_catalog(CATALOG)
    kinds = {name: match_of(cap)[0].name for name, cap in catalog.capabilities.items()}
    assert kinds == {"web.read": "http", "web.any": "http", "tools.search": "mcp", "tools.docs": "mcp"}
    assert catalog_from(catalog.to_dict()).hash == catalog.hash
    routes = {name: catalog.route_of(name) for name in catalog.names()}
    assert (routes["web.read"].scheme, routes["web.read"].host, routes["web.read"].port) == (
        "https", "api.example.com", 443)
    assert routes["web.any"] is None  # no scheme and port named: no one route
    assert (routes["tools.search"].scheme, routes["tools.search"].port) == ("http", 9000)


def test_a_capability_of_no_registered_kind_is_refused_naming_the_kinds() -> None:
    from tether.capability.errors import CatalogError

    with pytest.raises(CatalogError, match=r"unknown key 'grpc' \(allowed: credential, description, http, mcp\)"):
        parse_catalog("capabilities:\n  x: {grpc: {service: a.B}}\n")
    with pytest.raises(CatalogError, match="needs exactly one match: 'http' or 'mcp'"):
        parse_catalog("capabilities:\n  x: {description: nothing to match}\n")


def test_the_audit_wire_of_each_kind_reads_back_and_compares_through_its_kind() -> None:
    """A surface's wire is its kind's; read back by the kind; a widening is the kind's to name."""
    catalog = parse_catalog(CATALOG)
    for name in catalog.names():
        wire = audit.wire(catalog, name)
        ((key, value),) = wire.items()
        assert KINDS[key].wire_ok(value) and KINDS[key].widenings(value, value, Budget()) == []
    http = audit.wire(catalog, "web.read")["http"]
    assert [c[0] for c in KINDS["http"].widenings(http, {**http, "methods": ["GET", "DELETE"]}, Budget())] == [
        audit.METHODS]
    mcp = audit.wire(catalog, "tools.search")["mcp"]
    assert [c[0] for c in KINDS["mcp"].widenings(mcp, {**mcp, "tool": "delete"}, Budget())] == [audit.MCP_TOOL]
    assert not KINDS["http"].wire_ok(mcp) and not KINDS["mcp"].wire_ok(http)


@pytest.mark.parametrize("path", ["controlplane/audit.py", "cli/audit.py"])
def test_the_audit_surface_names_no_kind(path: str) -> None:
    """The surface and its diff ask the registry: no ``"http"`` or ``"mcp"`` string is spelled there, so a new
    kind changes neither (a test that fails on the if/elif they held before)."""
    tree = ast.parse((ROOT / path).read_text())
    spelled = [node.lineno for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value in KINDS]
    assert spelled == []
