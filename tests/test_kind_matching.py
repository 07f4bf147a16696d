"""The sidecar's matching behind the capability-kind registry.

1. Over generated catalogs (http and mcp capabilities on shared hosts, an http capability on an MCP endpoint,
   websockets, credentials) and generated requests (request lines, headers, JSON-RPC bodies of every item
   method), the registry's catalog index and ``decide`` give exactly the answers the matching had before it
   went behind the registry: same answer class, capability, tier, server, detail, items, callers, parsed body
   and refusal (code, message, details, HTTP status). The old matching is kept frozen in ``tests/oracle/`` as
   the reference.
2. A kind registered here, in the test (not shipped), is read from a catalog, indexed, and its requests are
   matched and decided through the real ``decide`` — no line of catalog.py or decision.py names it.

Pure: no sockets.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.oracle import catalog_v1, decision_v1
from tether.capability import errors as codes
from tether.capability import keys, kinds
from tether.capability.catalog import Capability, Catalog, catalog_from, fail, host_key
from tether.capability.chain import Verifier, mint_root
from tether.capability.credentials import Route
from tether.capability.glob import Budget
from tether.proxy import decision
from tether.proxy.decision import Allow, ChainState, Decision, Facts, Hold, Refusal, Refused, best, state_and_headers
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


# -- generated catalogs ---------------------------------------------------------------------------------------
HOSTS = ["a.example", "B.example", "mcp.example", "127.0.0.1"]
GLOBS = ["/files/*", "/files/a", "/*", "/mcp", "/mcp*", "/x/*/y", "/", "/files/**"]
SERVERS = ["http://mcp.example/mcp", "http://mcp.example:8080/mcp", "https://other.example/rpc", "stdio://tool"]
TOOLS = ["send", "read", "x"]
RESOURCES = ["docs://*", "docs://a/{id}", "file:///etc/*"]

http_match = st.fixed_dictionaries(
    {"host": st.sampled_from(HOSTS), "methods": st.lists(st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
                                                        min_size=1, max_size=3),
     "path": st.sampled_from(GLOBS)},
    optional={"port": st.sampled_from([80, 8080, 443]), "websocket": st.just(True)},
).map(lambda m: {**m, "methods": [*m["methods"], "GET"]} if m.get("websocket") else m)
mcp_match = st.one_of(
    st.builds(lambda url, tool: {"url": url, "tool": tool}, st.sampled_from(SERVERS), st.sampled_from(TOOLS)),
    st.builds(lambda url, uri: {"url": url, "resource": uri}, st.sampled_from(SERVERS), st.sampled_from(RESOURCES)),
    st.builds(lambda url, p: {"url": url, "prompt": p}, st.sampled_from(SERVERS), st.sampled_from(["brief", "x"])),
    st.builds(lambda url, k: {"url": url, k: True}, st.sampled_from(SERVERS),
              st.sampled_from(["logging", "completion", "subscriptions"])),
)
capability = st.tuples(
    st.one_of(st.builds(lambda m: {"http": m}, http_match), st.builds(lambda m: {"mcp": m}, mcp_match)),
    st.sampled_from([None] * 4 + ["tok", "other"]),  # now and then a credential: the route and server checks
).map(lambda pair: pair[0] if pair[1] is None else {**pair[0], "credential": pair[1]})
CREDENTIALS = {"tok": {"header": "Authorization", "format": "Bearer {secret}", "insecure_plain_http": "loopback"},
               "other": {"header": "X-Key"}}
raw_catalogs = st.dictionaries(st.from_regex(r"[a-z]{1,3}\.[a-z]{1,3}", fullmatch=True), capability,
                               min_size=1, max_size=8).map(lambda caps: {"capabilities": caps,
                                                                         "credentials": CREDENTIALS})


# -- generated requests ---------------------------------------------------------------------------------------
def rpc_message(method: str, i: int, value: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "tools/call": {"name": value, "arguments": {}}, "prompts/get": {"name": value},
        "resources/read": {"uri": value}, "resources/subscribe": {"uri": value},
        "resources/unsubscribe": {"uri": value}, "logging/setLevel": {"level": "info"},
        "completion/complete": {"ref": {"type": "ref/prompt", "name": value}, "argument": {"name": "a", "value": ""}},
        "subscriptions/listen": {"resources": [value]}, "initialize": {}, "tools/list": {},
    }.get(method, {})
    if method.startswith("notifications/"):
        return {"jsonrpc": "2.0", "method": method}
    return {"jsonrpc": "2.0", "id": i, "method": method, "params": params}


METHODS = ["tools/call", "prompts/get", "resources/read", "resources/subscribe", "resources/unsubscribe",
           "logging/setLevel", "completion/complete", "subscriptions/listen", "initialize", "tools/list",
           "notifications/initialized", "bogus/method"]
VALUES = [*TOOLS, "brief", "docs://a/1", "docs://b", "file:///etc/passwd", "docs://a/../b"]
bodies = st.lists(st.tuples(st.sampled_from(METHODS), st.sampled_from(VALUES)), min_size=1, max_size=3).flatmap(
    lambda msgs: st.sampled_from([False, True]).map(lambda batch: json.dumps(
        [rpc_message(m, i, v) for i, (m, v) in enumerate(msgs)] if batch or len(msgs) > 1
        else rpc_message(msgs[0][0], 0, msgs[0][1])).encode()))
PATHS = ["/files/a", "/files/b/c", "/mcp", "/mcp/", "/rpc", "/", "/x/1/y", "/files/%2e%2e/a", "/files/a?_method=PUT",
         "/files/a#x", "*", "/other"]


@st.composite
def requests(draw: st.DrawFn) -> Facts:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "get", "CONNECT"]))
    scheme = draw(st.sampled_from(["http", "https"]))
    host = draw(st.sampled_from([*HOSTS, "b.example", "other.example", "tool.stdio.tether", "nowhere.example"]))
    port = draw(st.sampled_from([80, 8080, 443]))
    path = draw(st.sampled_from(PATHS))
    websocket = draw(st.booleans())
    more: dict[str, Any] = {}
    if draw(st.booleans()):
        more["body"] = draw(bodies)
        more["content_encoding"] = draw(st.sampled_from([None, "identity", "gzip"]))
    if draw(st.integers(0, 5)) == 0:
        more["host_header"] = draw(st.sampled_from([f"{host}:{port}", "evil.example", host]))
    if draw(st.integers(0, 5)) == 0:
        more["mcp_method"] = draw(st.sampled_from(METHODS))
    if draw(st.integers(0, 7)) == 0:
        more["rewrite_headers"] = ("x-original-url",)
    target = path.split("?", 1)[0] if path.startswith("/") else "/"
    return Facts(method=method.upper(), sent_method=method, host=host, port=port, path=path,
                 url=f"{scheme}://{host}:{port}{target}", now=T0 + 10, now_mono=MONO + 1,
                 websocket=websocket and method.upper() == "GET", upgrade=websocket, **more)


def fingerprint(answer: Any) -> tuple[Any, ...]:
    refusal = getattr(answer, "refusal", None)
    said = None if refusal is None else (refusal.code, str(refusal), dict(refusal.details), refusal.http_status)
    return (type(answer).__name__, answer.capability, answer.tier, answer.server, answer.detail, answer.tools,
            answer.parsed, answer.callers, said)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=raw_catalogs, data=st.data())
def test_the_registrys_matching_answers_as_the_old_matching(raw: dict[str, Any], data: st.DataObject) -> None:
    try:
        old_catalog = catalog_v1.catalog_from(raw)
    except Exception as exc:  # the same catalogs are refused, with the same words
        event("catalog refused")
        with pytest.raises(type(exc), match="^" + re.escape(str(exc)) + "$"):
            catalog_from(raw)
        return
    new_catalog = catalog_from(raw)
    event("catalog read" + (" (a credential)" if any(c.credential for c in new_catalog.capabilities.values()) else ""))
    assert new_catalog.hash == old_catalog.hash and new_catalog.to_dict() == old_catalog.to_dict()
    names = sorted(new_catalog.names())
    grants = data.draw(st.dictionaries(st.sampled_from(names), st.sampled_from(["direct", "approval"]), min_size=1))
    mode = data.draw(st.sampled_from([None, None, None, "drain"]))
    old_state, new_state = chain_for(old_catalog, grants, mode), chain_for(new_catalog, grants, mode)
    for facts in data.draw(st.lists(requests(), min_size=1, max_size=6)):
        assert fingerprint(decision.decide(new_catalog, new_state, facts)) == fingerprint(
            decision_v1.decide(old_catalog, old_state, facts)), facts
        assert new_catalog.knows_host(facts.host, facts.port) == old_catalog.knows_host(facts.host, facts.port)
        tunnel = decision.decide_tunnel(new_catalog, new_state, facts.host, facts.port, facts.now, facts.now_mono)
        old_tunnel = decision_v1.decide_tunnel(old_catalog, old_state, facts.host, facts.port, facts.now,
                                               facts.now_mono)
        assert (tunnel and (tunnel.code, str(tunnel))) == (old_tunnel and (old_tunnel.code, str(old_tunnel)))
        for server in {new_catalog.mcp_server(facts.url), *(c.mcp.server for c in new_catalog.capabilities.values()
                                                            if c.mcp is not None)} - {None}:
            assert new_catalog.mcp_server(facts.url) == old_catalog.mcp_server(facts.url)
            assert new_catalog.mcp_capabilities(server) == old_catalog.mcp_capabilities(server)
            assert new_catalog.mcp_tools(server) == old_catalog.mcp_tools(server)
            assert new_catalog.mcp_credential(server) == old_catalog.mcp_credential(server)
            for uri in VALUES:
                assert new_catalog.match_resource(server, uri) == old_catalog.match_resource(server, uri)
                assert new_catalog.match_resource_template(server, uri) == old_catalog.match_resource_template(
                    server, uri)


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
    """A toy gRPC kind: ``grpc: {host, port, service, method}``, a unary call as a POST to /Service/Method."""

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


def decide_grpc(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision | None:
    index = catalog.index("grpc")
    names = index.match(facts.host, facts.port, facts.path) if index is not None and facts.method == "POST" else []
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
    kinds.register(GrpcKind())
    decision.register("grpc", decide_grpc)
    try:
        yield
    finally:
        decision.unregister("grpc")
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
    assert [name for name, _ in decision._deciders()] == ["mcp", "http"]


def test_catalog_and_decision_name_no_kind_in_their_branches() -> None:
    """No ``if``/``elif`` (or ``match``) in catalog.py or decision.py compares against a kind's name or reads a
    kind-named attribute of a capability: what depends on the kind is the kind's module."""
    kind_names = set(kinds.KINDS)
    for path in (ROOT / "capability" / "catalog.py", ROOT / "proxy" / "decision.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Match):
                test = node.subject if isinstance(node, ast.Match) else node.test
                for part in ast.walk(test):
                    named = (isinstance(part, ast.Constant) and part.value in kind_names) or (
                        isinstance(part, ast.Attribute) and part.attr in kind_names)
                    assert not named, f"{path.name}:{part.lineno} branches on a kind's name"
