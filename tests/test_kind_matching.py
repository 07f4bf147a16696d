"""The sidecar's matching behind the capability-kind registry.

1. A kind registered here, in the test (not shipped), as one object (its model, index and decider: what a kind's
   one module holds), is read from a catalog, indexed, and its requests are matched and decided through the
   real ``decide`` — no line of catalog.py or either decision.py names it.
2. The capability's old fields still read its match, and the decision modules branch on no kind's name.

What the shipped kinds' matching answers is pinned against the documented rules in tests/test_kind_rules.py.

Pure: no sockets.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tether.capability import errors as codes
from tether.capability import keys, kinds
from tether.capability.catalog import Capability, Catalog, catalog_from, fail, host_key
from tether.capability.chain import Verifier, mint_root
from tether.capability.credentials import Route
from tether.capability.decision import (
    Allow,
    ChainState,
    Decision,
    Facts,
    Hold,
    Refusal,
    Refused,
    best,
    state_and_headers,
)
from tether.capability.glob import Budget
from tether.proxy import decision
from tether.proxy.state import SidecarState

ROOT = Path(__file__).resolve().parent.parent / "tether"
TRUST = keys.generate()
AGENT_KEY = keys.generate()
T0 = 1_750_000_000.0
MONO = 1000.0


def chain_for(catalog: Any, grants: Mapping[str, str], mode: str | None) -> SidecarState:
    wire = mint_root(TRUST, agent="agent-1", subject_key=AGENT_KEY.public_key(), caps=dict(grants), now=T0,
                     ttl_s=3600, depth=0, catalog=catalog)
    verifier = Verifier(TRUST.public_key(), catalog_hash=catalog.hash, leeway=30)
    state = SidecarState(verifier.verify(wire, now=T0), verifier, lease_ttl_s=15.0)
    state.renewed(MONO)
    if mode is not None:
        state.commanded({"termination_id": "t1", "mode": mode})
    return state


def test_the_capabilitys_old_fields_read_its_match() -> None:
    catalog = catalog_from({"capabilities": {
        "web": {"http": {"host": "a.example", "methods": ["GET"], "path": "/*"}},
        "tool": {"mcp": {"url": "http://mcp.example/mcp", "tool": "send"}}}})
    web, tool = catalog.capabilities["web"], catalog.capabilities["tool"]
    assert (web.kind, web.http, web.mcp) == ("http", web.match, None)
    assert (tool.kind, tool.mcp, tool.http) == ("mcp", tool.match, None)
    with pytest.raises(AttributeError):
        _ = web.grpc


# -- a kind of the test's own -----------------------------------------------------------------------------------
class GrpcIndex:
    """(host, port, "/Service/Method") -> capability names, in catalog order."""

    def __init__(self, entries: Sequence[tuple[int, Capability]]) -> None:
        self.methods: dict[tuple[str, int, str], list[str]] = {}
        for _, cap in entries:
            m = cap.match
            self.methods.setdefault((m["host"], m["port"], f"/{m['service']}/{m['method']}"), []).append(cap.name)
        self.any_port_hosts: frozenset[str] = frozenset()
        self.host_ports = frozenset((host, port) for host, port, _ in self.methods)

    def match(self, host: str, port: int, path: str) -> list[str]:
        return list(self.methods.get((host_key(host), port, path), ()))


class GrpcKind:
    """A toy gRPC kind: ``grpc: {host, port, service, method}``, a unary call as a POST to /Service/Method. One
    class, as a kind is one module: its catalog entry, its index, its audit surface and its decision."""

    name = "grpc"

    def parse(self, source: str, where: str, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict) or set(raw) != {"host", "port", "service", "method"}:
            raise fail(source, where, "expected host, port, service and method")
        return {**raw, "host": host_key(raw["host"])}

    def check(self, source: str, caps: Sequence[Capability]) -> None:
        pass

    def index(self, entries: Sequence[tuple[int, Capability]]) -> GrpcIndex:
        return GrpcIndex(entries)

    def to_dict(self, match: dict[str, Any]) -> dict[str, Any]:
        return dict(match)

    def route(self, match: dict[str, Any]) -> Route | None:
        return Route("https", match["host"], match["port"])

    def wire(self, match: dict[str, Any]) -> dict[str, Any]:
        return dict(match)

    def wire_ok(self, value: Any) -> bool:
        return isinstance(value, dict)

    def widenings(self, old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[kinds.Change]:
        return [] if old == new else [("grpc_changed", dict(old), dict(new), "")]

    def text(self, value: Mapping[str, Any]) -> str:
        return f"{value['service']}/{value['method']}"

    @staticmethod
    def decide(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision | None:
        index = catalog.index("grpc")
        names = index.match(facts.host, facts.port, facts.path) if index and facts.method == "POST" else []
        if not names:
            return None
        capability, tier = best(chain, names)
        refusal = state_and_headers(chain, facts)
        if refusal is None and tier == "absent":
            refusal = Refusal(codes.CAPABILITY_ABSENT, f"{capability} is not granted to {chain.agent}")
        if refusal is not None:
            return Refused(refusal=refusal, capability=capability, tier=tier)
        return (Hold if tier == "approval" else Allow)(capability=capability, tier=tier, detail="grpc")


@contextmanager
def grpc_registered() -> Iterator[None]:
    kinds.register(GrpcKind())  # the one registration a kind needs
    try:
        yield
    finally:
        kinds.unregister("grpc")


TOY = {"capabilities": {
    "ledger.get": {"grpc": {"host": "Ledger.example", "port": 443, "service": "ledger.Ledger", "method": "Get"}},
    "ledger.put": {"grpc": {"host": "ledger.example", "port": 443, "service": "ledger.Ledger", "method": "Put"}},
    "ledger.drop": {"grpc": {"host": "ledger.example", "port": 443, "service": "ledger.Ledger", "method": "Drop"}},
    "web": {"http": {"host": "ledger.example", "port": 443, "methods": ["GET"], "path": "/status"}}}}


def grpc_call(method: str, *, http_method: str = "POST") -> Facts:
    path = f"/ledger.Ledger/{method}"
    return Facts(method=http_method, sent_method=http_method, host="ledger.example", port=443, path=path,
                 url=f"https://ledger.example:443{path}", now=T0 + 10, now_mono=MONO + 1)


def test_a_kind_registered_in_the_test_is_read_matched_and_decided_through_the_real_decide() -> None:
    with grpc_registered():
        catalog = catalog_from(TOY)
        assert kinds.asked() == ["grpc", "mcp", "http"]  # asked before the shipped kinds
        assert catalog.capabilities["ledger.get"].kind == "grpc"
        assert catalog_from(catalog.to_dict()).hash == catalog.hash  # written back through the kind
        assert catalog.route_of("ledger.put") == Route("https", "ledger.example", 443)
        assert catalog.knows_host("ledger.example", 443) and not catalog.knows_host("ledger.example", 8443)
        state = chain_for(catalog, {"ledger.get": "direct", "ledger.put": "approval", "web": "direct"}, None)
        answers = {m: decision.decide(catalog, state, grpc_call(m)) for m in ("Get", "Put", "Drop", "Nope")}
        assert (type(answers["Get"]), answers["Get"].capability, answers["Get"].detail) == (Allow, "ledger.get",
                                                                                            "grpc")
        assert (type(answers["Put"]), answers["Put"].tier) == (Hold, "approval")
        assert isinstance(answers["Drop"], Refused) and answers["Drop"].refusal.code == codes.CAPABILITY_ABSENT
        assert answers["Drop"].capability == "ledger.drop"  # matched, not granted
        assert isinstance(answers["Nope"], Refused) and answers["Nope"].capability is None  # no kind claimed it
        assert answers["Nope"].refusal.code == codes.CAPABILITY_ABSENT  # a host the catalog knows
        web = Facts(method="GET", sent_method="GET", host="ledger.example", port=443, path="/status",
                    url="https://ledger.example:443/status", now=T0 + 10, now_mono=MONO + 1)
        answer = decision.decide(catalog, state, web)
        assert (type(answer), answer.capability) == (Allow, "web")  # the http kind still answers for its own
        drained = chain_for(catalog, {"ledger.get": "direct"}, "drain")
        assert decision.decide(catalog, drained, grpc_call("Get")).refusal.code == codes.DRAINING
    with pytest.raises(Exception, match="unknown key 'grpc'"):
        catalog_from(TOY)  # gone with its registration
    assert kinds.asked() == ["mcp", "http"] and decision.DECIDERS == [kinds.KINDS["mcp"].decide,
                                                                      kinds.KINDS["http"].decide]


def test_catalog_and_decision_name_no_kind_in_their_branches() -> None:
    """No ``if``/``elif`` (or ``match``) in catalog.py or either decision.py compares against a kind's name or reads a
    kind-named attribute of a capability: what depends on the kind is the kind's module."""
    kind_names = set(kinds.KINDS)
    for path in (ROOT / "capability" / "catalog.py", ROOT / "capability" / "decision.py",
                 ROOT / "proxy" / "decision.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Match):
                test = node.subject if isinstance(node, ast.Match) else node.test
                for part in ast.walk(test):
                    named = (isinstance(part, ast.Constant) and part.value in kind_names) or (
                        isinstance(part, ast.Attribute) and part.attr in kind_names)
                    assert not named, f"{path.name}:{part.lineno} branches on a kind's name"
