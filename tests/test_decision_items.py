"""The decision for MCP items beyond tools (resources, prompts, completions, logging, subscriptions), as tables
and a property against an oracle written from the catalog's documented rules, with no proxy."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import errors as codes
from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import Verifier, mint_root
from tether.proxy import mcp
from tether.proxy.decision import Allow, Facts, Hold, Refused, decide
from tether.proxy.state import SidecarState

URL = "http://mcp.example/mcp"
CATALOG = parse_catalog(f"""
capabilities:
  add:      {{mcp: {{url: "{URL}", tool: add}}}}
  docs:     {{mcp: {{url: "{URL}", resource: "docs://public/*"}}}}
  plans:    {{mcp: {{url: "{URL}", resource: "docs://private/*"}}}}
  profile:  {{mcp: {{url: "{URL}", resource: "users://{{id}}/profile"}}}}
  greet:    {{mcp: {{url: "{URL}", prompt: greet}}}}
  leak:     {{mcp: {{url: "{URL}", prompt: leak}}}}
  log:      {{mcp: {{url: "{URL}", logging: true}}}}
  complete: {{mcp: {{url: "{URL}", completion: true}}}}
  subs:     {{mcp: {{url: "{URL}", subscriptions: true}}}}
  files:    {{http: {{host: files.example, methods: [GET], path: "/*"}}}}
""")
TRUST, AGENT_KEY = keys.generate(), keys.generate()
T0, MONO = 1_750_000_000.0, 1000.0
GRANTS = {"docs": "direct", "plans": "approval", "profile": "direct", "greet": "direct", "log": "direct",
          "complete": "direct", "subs": "direct"}  # absent: add, leak


def chain_state(grants: dict[str, Any]) -> SidecarState:
    wire = mint_root(TRUST, agent="agent-1", subject_key=AGENT_KEY.public_key(), caps=grants, now=T0, ttl_s=3600,
                     depth=0, catalog=CATALOG)
    verifier = Verifier(TRUST.public_key(), catalog_hash=CATALOG.hash, leeway=30)
    state = SidecarState(verifier.verify(wire, now=T0), verifier, lease_ttl_s=15.0)
    state.renewed(MONO)
    return state


STATE = chain_state(GRANTS)


def rpc(method: str, params: dict[str, Any] | None = None, msg_id: Any = 1, **more: Any) -> Facts:
    body = {"jsonrpc": "2.0", "method": method, **({"id": msg_id} if msg_id is not None else {}),
            **({"params": params} if params is not None else {})}
    return Facts(method="POST", sent_method="POST", host="mcp.example", port=80, path="/mcp",
                 url="http://mcp.example:80/mcp", now=T0 + 10, now_mono=MONO + 1, body=json.dumps(body).encode(),
                 **more)


def read(uri: str, **more: Any) -> Facts:
    return rpc("resources/read", {"uri": uri}, **more)


def complete(ref: dict[str, Any]) -> Facts:
    return rpc("completion/complete", {"ref": ref, "argument": {"name": "a", "value": ""}})


def listen(uris: list[str] | None) -> Facts:
    notifications: dict[str, Any] = {"toolsListChanged": True}
    if uris is not None:
        notifications["resourceSubscriptions"] = uris
    return rpc("subscriptions/listen", {"notifications": notifications})


# (why, request, answer type, capability, units counted)
DECIDED = [
    ("a granted resource", read("docs://public/readme"), Allow, "docs", ("docs",)),
    ("a resource through its template", read("users://42/profile"), Allow, "profile", ("profile",)),
    ("an approval-tier resource", read("docs://private/plan"), Hold, "plans", ("plans",)),
    ("a granted prompt", rpc("prompts/get", {"name": "greet"}), Allow, "greet", ("greet",)),
    ("logging", rpc("logging/setLevel", {"level": "debug"}), Allow, "log", ("log",)),
    ("a subscription counts as subscriptions", rpc("resources/subscribe", {"uri": "docs://public/a"}), Allow,
     "subs", ("subs",)),
    ("ending a subscription counts nothing", rpc("resources/unsubscribe", {"uri": "docs://public/a"}), Allow,
     None, None),
    ("a completion for a granted prompt", complete({"type": "ref/prompt", "name": "greet"}), Allow, "complete",
     ("complete",)),
    ("a completion for a granted template", complete({"type": "ref/resource", "uri": "users://{id}/profile"}),
     Allow, "complete", ("complete",)),
    ("a listen for list changes is plumbing", listen(None), Allow, None, None),
    ("a listen for granted resources", listen(["docs://public/a", "users://1/profile"]), Allow, "subs", ("subs",)),
    ("the lists are plumbing", rpc("resources/templates/list"), Allow, None, None),
    ("an Mcp-Name that says what the body says", read("docs://public/a", mcp_name="docs://public/a"), Allow, "docs",
     ("docs",)),
    ("... in base64", read("docs://public/á", mcp_name="=?base64?" + base64.b64encode(
        "docs://public/á".encode()).decode() + "?="), Allow, "docs", ("docs",)),
]


@pytest.mark.parametrize(("why", "request_facts", "kind", "capability", "units"), DECIDED, ids=[d[0] for d in DECIDED])
def test_items_granted(why: str, request_facts: Facts, kind: type, capability: str | None,
                       units: tuple[str, ...] | None) -> None:
    answer = decide(CATALOG, STATE, request_facts)
    assert type(answer) is kind, answer
    assert (answer.capability, answer.tools) == (capability, units), answer


ABSENT = codes.CAPABILITY_ABSENT
# (why, state, request, capability the refusal names: what it matched, for the report)
REFUSED = [
    ("a resource no capability admits", STATE, read("vault://root"), None),
    ("a traversal out of a granted glob", STATE, read("docs://public/../private/x"), None),
    ("an encoded traversal", STATE, read("docs://public/%2E%2E/private/x"), None),
    ("a resource granted to someone else", chain_state({"docs": "direct"}), read("docs://private/plan"), "plans"),
    ("an absent prompt", STATE, rpc("prompts/get", {"name": "leak"}), "leak"),
    ("a prompt not in the catalog", STATE, rpc("prompts/get", {"name": "nope"}), None),
    ("logging not granted", chain_state({"docs": "direct"}), rpc("logging/setLevel", {"level": "debug"}), "log"),
    ("subscriptions not granted", chain_state({"docs": "direct"}),
     rpc("resources/subscribe", {"uri": "docs://public/a"}), "subs"),
    ("unsubscribing with subscriptions not granted", chain_state({"docs": "direct"}),
     rpc("resources/unsubscribe", {"uri": "docs://public/a"}), "subs"),
    ("a subscription to an absent resource", STATE, rpc("resources/subscribe", {"uri": "vault://x"}), None),
    ("a completion for an absent prompt", STATE, complete({"type": "ref/prompt", "name": "leak"}), "leak"),
    ("a completion for a template wider than the grant", STATE,
     complete({"type": "ref/resource", "uri": "users://{id}"}), "complete"),
    ("a completion with completion not granted", chain_state({"greet": "direct"}),
     complete({"type": "ref/prompt", "name": "greet"}), "complete"),
    ("a completion without a ref", STATE, rpc("completion/complete", {"argument": {}}), None),
    ("a listen for an absent resource", STATE, listen(["docs://public/a", "vault://x"]), None),
    ("a listen whose subscriptions are not URIs", STATE, listen([3]), None),  # type: ignore[list-item]
    ("resources/read without a uri", STATE, rpc("resources/read", {}), None),
    ("an Mcp-Name naming another resource", STATE, read("docs://public/a", mcp_name="docs://private/plan"), "docs"),
    ("an Mcp-Name naming another prompt", STATE, rpc("prompts/get", {"name": "greet"}, mcp_name="leak"), "greet"),
    ("an Mcp-Name in broken base64", STATE, read("docs://public/a", mcp_name="=?base64?!!?="), "docs"),
    ("plumbing with nothing granted on the server", chain_state({"files": "direct"}), rpc("initialize", {}), None),
]


@pytest.mark.parametrize(("why", "state", "request_facts", "capability"), REFUSED, ids=[r[0] for r in REFUSED])
def test_items_refused(why: str, state: SidecarState, request_facts: Facts, capability: str | None) -> None:
    answer = decide(CATALOG, state, request_facts)
    assert isinstance(answer, Refused), answer
    assert answer.refusal.code == ABSENT and answer.refusal.message
    assert answer.capability == capability, answer


def test_plumbing_needs_any_item_not_a_tool() -> None:
    """An agent that holds only a resource on a server may open a session with it."""
    state = chain_state({"docs": "direct"})
    for method in ("initialize", "ping", "tools/list", "prompts/list", "resources/list"):
        assert isinstance(decide(CATALOG, state, rpc(method, {})), Allow), method
    assert isinstance(decide(CATALOG, state, rpc("notifications/initialized", msg_id=None)), Allow)


# -- a property: nothing leaves that the oracle would not grant -------------------------------------------------
def oracle_resource(grants: dict[str, str], uri: str) -> str | None:
    """The tier of the best resource capability for ``uri``, from the catalog's rules as documented."""
    if ".." in uri.split("://", 1)[-1].split("/") or "%" in uri:
        return None
    patterns = {"docs": r"docs://public/.*", "plans": r"docs://private/.*", "profile": r"users://.*/profile"}
    tiers = [grants[c] for c, p in patterns.items() if c in grants and re.fullmatch(p, uri, re.S)]
    return "direct" if "direct" in tiers else "approval" if tiers else None


URIS = st.sampled_from(["docs://public/a", "docs://private/b", "users://1/profile", "users://1/x", "vault://k",
                        "docs://public/../private/b", "docs://public/%2e%2e/x", "docs://publicx", "users:///profile"])
ITEM_GRANTS = st.dictionaries(st.sampled_from(["docs", "plans", "profile", "subs"]),
                              st.sampled_from(["direct", "approval"]), min_size=1)


@settings(max_examples=200, deadline=None)
@given(grants=ITEM_GRANTS, uri=URIS, method=st.sampled_from(["resources/read", "resources/subscribe"]))
def test_never_lets_go_a_resource_the_chain_does_not_grant(grants: dict[str, str], uri: str, method: str) -> None:
    answer = decide(CATALOG, chain_state(grants), rpc(method, {"uri": uri}))
    tier = oracle_resource(grants, uri)
    if method == "resources/subscribe" and "subs" not in grants:
        tier = None
    if tier is None:
        assert isinstance(answer, Refused), (grants, uri, answer)
        return
    assert isinstance(answer, Allow | Hold), (grants, uri, answer)
    held_by = grants["subs"] if method == "resources/subscribe" else tier
    assert isinstance(answer, Hold) == (held_by == "approval"), (grants, uri, answer)


def test_refusal_bodies_answer_each_request_as_a_server_would() -> None:
    data = {"code": ABSENT, "message": "m"}
    batch = mcp.parse(json.dumps([
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x"}},
        {"jsonrpc": "2.0", "id": 2, "method": "resources/read", "params": {"uri": "a://b"}},
        {"jsonrpc": "2.0", "method": "notifications/progress"}]).encode())
    call, read_ = json.loads(mcp.error_body(batch, None, "m", data))
    assert call["result"]["isError"] is True and call["result"]["_meta"]["tether/error"] == data
    assert "resultType" not in call["result"]  # a 2025 request: no field its schema does not know
    assert read_["error"] == {"code": mcp.JSONRPC_REFUSED, "message": "m", "data": data}
    assert mcp.answers_requests(batch)
    modern = mcp.parse(json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "x", "_meta": {mcp.PROTOCOL_META: "2026-07-28"}}}).encode())
    assert json.loads(mcp.error_body(modern, None, "m", data))["result"]["resultType"] == "complete"
    assert json.loads(mcp.error_body(modern, None, "m", data, tool_errors=False))["error"]["data"] == data
    notes = mcp.parse(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
    assert not mcp.answers_requests(notes) and not mcp.answers_requests(None)
