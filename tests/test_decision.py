"""The enforcement decision (tether/proxy/decision.py) as tables and properties, in milliseconds, with no proxy.

Real chains (minted and verified), a real catalog and a real ``SidecarState``; only the request is written
out as facts. Every code ``decide``, ``decide_tunnel`` and ``after_approval`` return is in a table here; the
other codes a sidecar answers with come from its edges (a capture or spool that cannot be written, a
credential or budget that is not there) and are tested end to end (test_sidecar_faults, test_credentials,
test_budgets).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import errors as codes
from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import Verifier, mint_root
from tether.proxy.decision import (
    REWRITE_HEADERS,
    Allow,
    Facts,
    Hold,
    ReadBody,
    Refused,
    after_approval,
    decide,
    decide_tunnel,
)
from tether.proxy.state import SidecarState

CATALOG = parse_catalog("""
capabilities:
  files.read:   {http: {host: files.example, methods: [GET], path: "/files/*"}}
  files.write:  {http: {host: files.example, methods: [PUT, POST], path: "/files/*"}}
  files.purge:  {http: {host: files.example, methods: [DELETE], path: "/files/*"}}
  files.list:   {http: {host: list.example, port: 8443, methods: [GET], path: "/list"}}
  mail.send:    {mcp: {url: "http://mcp.example/mcp", tool: send}}
  mail.read:    {mcp: {url: "http://mcp.example/mcp", tool: read}}
  mail.delete:  {mcp: {url: "http://mcp.example/mcp", tool: delete}}
  other.tool:   {mcp: {url: "http://other.example/mcp", tool: x}}
""")
CAPS = sorted(CATALOG.names())
TRUST = keys.generate()
AGENT_KEY = keys.generate()
T0 = 1_750_000_000.0
TTL = 3600
MONO = 1000.0  # the monotonic clock the lease runs on
GRANTS = {"files.read": "direct", "files.write": "approval", "mail.send": "direct", "mail.read": "approval"}


def chain_state(grants: dict[str, str] | None = None, *, lease: bool = True) -> SidecarState:
    wire = mint_root(TRUST, agent="agent-1", subject_key=AGENT_KEY.public_key(), caps=grants or GRANTS, now=T0,
                     ttl_s=TTL, depth=0, catalog=CATALOG)
    verifier = Verifier(TRUST.public_key(), catalog_hash=CATALOG.hash, leeway=30)
    state = SidecarState(verifier.verify(wire, now=T0), verifier, lease_ttl_s=15.0)
    if lease:
        state.renewed(MONO)
    return state


def facts(method: str = "GET", path: str = "/files/a", *, host: str = "files.example", port: int = 80,
          scheme: str = "http", **more: Any) -> Facts:
    url = f"{scheme}://{host}:{port}{path.split('?', 1)[0]}"
    values: dict[str, Any] = {"method": method.upper(), "sent_method": method, "host": host, "port": port,
                              "path": path, "url": url, "now": T0 + 10, "now_mono": MONO + 1}
    values.update(more)
    return Facts(**values)


def rpc(*messages: dict[str, Any], batch: bool = False, **more: Any) -> Facts:
    body = [{"jsonrpc": "2.0", **m} for m in messages]
    raw = json.dumps(body if batch else body[0]).encode()
    return facts("POST", "/mcp", host="mcp.example", body=raw, **more)


def call(tool: str, id: int = 1) -> dict[str, Any]:
    return {"id": id, "method": "tools/call", "params": {"name": tool, "arguments": {}}}


STATE = chain_state()


# -- answers that let the call go (or wait) ----------------------------------------------------------------
@pytest.mark.parametrize(("request_facts", "kind", "capability", "tier"), [
    (facts(), Allow, "files.read", "direct"),
    (facts("PUT", "/files/a"), Hold, "files.write", "approval"),
    (facts(host="FILES.example.", host_header="files.example:80"), Allow, "files.read", "direct"),
    (facts(chain_header=STATE.wire), Allow, "files.read", "direct"),  # its own chain: accepted, then removed
    (rpc(call("send")), Allow, "mail.send", "direct"),
    (rpc(call("read")), Hold, "mail.read", "approval"),
    (rpc(call("send"), call("read", 2), batch=True), Hold, "mail.send,mail.read", "approval"),
    (rpc({"id": 1, "method": "initialize", "params": {}}), Allow, None, None),
    (rpc({"method": "notifications/initialized"}), Allow, None, None),
    (facts("GET", "/mcp", host="mcp.example"), Allow, None, None),  # the server's stream to the client
    (facts("DELETE", "/mcp", host="mcp.example"), Allow, None, None),  # the session's end
])
def test_allowed_and_held(request_facts: Facts, kind: type, capability: str | None, tier: str | None) -> None:
    answer = decide(CATALOG, STATE, request_facts)
    assert type(answer) is kind, answer
    assert (answer.capability, answer.tier) == (capability, tier)


def test_a_jsonrpc_post_is_decided_on_its_body() -> None:
    answer = decide(CATALOG, STATE, replace(rpc(call("send")), body=None))
    assert isinstance(answer, ReadBody) and answer.server == "http://mcp.example:80/mcp"
    answer = decide(CATALOG, STATE, rpc(call("send"), call("send", 2), {"method": "ping", "id": 3}, batch=True))
    assert isinstance(answer, Allow) and answer.tools == ("mail.send", "mail.send")
    assert [m.method for m in answer.parsed.messages] == ["tools/call", "tools/call", "ping"]
    plumbing = decide(CATALOG, STATE, rpc({"id": 1, "method": "tools/list"}))
    assert plumbing.detail == "mcp tools/list" and plumbing.tools is None


# -- refusals: every code decide answers with ------------------------------------------------------------
def revoked() -> SidecarState:
    state = chain_state()
    state.revoke(list(state.chain.jtis), MONO)
    return state


def commanded(mode: str) -> SidecarState:
    state = chain_state()
    state.commanded({"termination_id": "t1", "mode": mode})
    if mode == "terminated":
        state.quiesced()
    return state


ABSENT, UNKNOWN = codes.CAPABILITY_ABSENT, codes.UNKNOWN_DESTINATION
REFUSALS = [
    # what the request names
    ("no capability on a known host", STATE, facts("GET", "/elsewhere"), ABSENT, None),
    ("a capability not granted", STATE, facts("DELETE", "/files/a"), ABSENT, None),
    ("a host not in the catalog", STATE, facts(host="evil.example"), UNKNOWN, None),
    ("a port no capability names", STATE, facts("GET", "/list", host="list.example", port=8080), UNKNOWN, None),
    ("a Host header naming another host", STATE, facts(host_header="evil.example"), UNKNOWN, None),
    ("a Host header naming another port", STATE, facts(host_header="files.example:81"), UNKNOWN, None),
    ("an asterisk-form target", STATE, facts("OPTIONS", "*"), ABSENT, "request_target"),
    ("a fragment", STATE, facts(path="/files/a#x"), ABSENT, "request_target"),
    ("a lower-case method", STATE, facts("get"), ABSENT, "method"),
    ("a traversal", STATE, facts(path="/files/%2e%2e/secret"), ABSENT, None),
    *[(f"the {h} header", STATE, facts(rewrite_headers=(h,)), ABSENT, "rewrite_header") for h in REWRITE_HEADERS],
    ("a protocol upgrade", STATE, facts(upgrade=True), ABSENT, None),
    ("a CONNECT inside a tunnel", STATE, facts("CONNECT", "/files/a"), ABSENT, None),
    ("another chain in Tether-Chain", STATE, facts(chain_header="a.b.c"), codes.CHAIN_INVALID, "foreign_chain"),
    # MCP
    ("a tool not granted", STATE, rpc(call("delete")), ABSENT, None),
    ("a tool not in the catalog", STATE, rpc(call("nope")), ABSENT, None),
    ("one tool of a batch not granted", STATE, rpc(call("send"), call("delete", 2), batch=True), ABSENT, None),
    ("a method the catalog does not describe", STATE, rpc({"id": 1, "method": "tools/delete"}), ABSENT, None),
    ("plumbing with no tool granted on that server", chain_state({"files.read": "direct"}),
     rpc({"id": 1, "method": "initialize"}), ABSENT, None),
    ("a PUT to an MCP endpoint", STATE, facts("PUT", "/mcp", host="mcp.example"), ABSENT, None),
    ("a body that is not JSON", STATE, replace(rpc(call("send")), body=b"{"), ABSENT, None),
    ("an encoded body", STATE, rpc(call("send"), content_encoding="gzip"), ABSENT, None),
    ("a duplicated key", STATE, replace(rpc(call("send")), body=b'{"jsonrpc":"2.0","id":1,"method":"ping",'
                                                               b'"Method":"tools/call"}'), ABSENT, None),
    ("an mcp-method header that is not the body's", STATE, rpc(call("send"), mcp_method="ping"), ABSENT, None),
    ("an mcp-name header that is not the body's", STATE, rpc(call("send"), mcp_name="read"), ABSENT, None),
    # the chain state
    ("a revoked chain", revoked(), facts(), codes.CHAIN_REVOKED, "revoked"),
    ("an expired chain", STATE, facts(now=T0 + TTL + 31), codes.CHAIN_EXPIRED, "expired"),
    ("a chain not yet valid", STATE, facts(now=T0 - 31), codes.CHAIN_EXPIRED, "not_yet_valid"),
    ("no lease yet", chain_state(lease=False), facts(), codes.LEASE_EXPIRED, None),
    ("a lease run out", STATE, facts(now_mono=MONO + 15), codes.LEASE_EXPIRED, None),
    ("a drain", commanded("drain"), facts(), codes.DRAINING, None),
    ("an abort", commanded("abort"), facts(), codes.DRAINING, None),
    ("a termination", commanded("terminated"), facts(), codes.TERMINATED, None),
    ("a termination, for an MCP call", commanded("terminated"), rpc(call("send")), codes.TERMINATED, None),
]


@pytest.mark.parametrize(("why", "state", "request_facts", "code", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused(why: str, state: SidecarState, request_facts: Facts, code: str, reason: str | None) -> None:
    answer = decide(CATALOG, state, request_facts)
    assert isinstance(answer, Refused), f"{why}: {answer}"
    assert answer.refusal.code == code
    assert answer.refusal.details.get("reason") == reason
    assert answer.refusal.message


def test_a_refusal_names_what_the_call_matched() -> None:
    """The report and the error body name the capability even when the call is refused."""
    answer = decide(CATALOG, revoked(), facts("PUT", "/files/a"))
    assert isinstance(answer, Refused) and (answer.capability, answer.tier) == ("files.write", "approval")
    answer = decide(CATALOG, STATE, rpc(call("delete")))
    assert isinstance(answer, Refused) and answer.capability == "mail.delete"
    assert answer.refusal.details["capability"] == "mail.delete" and answer.parsed is not None
    assert answer.server == "http://mcp.example:80/mcp"  # the error body is JSON-RPC


@pytest.mark.parametrize(("state", "host", "port", "code"), [
    (STATE, "files.example", 443, None),
    (STATE, "evil.example", 443, UNKNOWN),
    (commanded("terminated"), "files.example", 443, codes.TERMINATED),
    (revoked(), "files.example", 443, codes.CHAIN_REVOKED),
])
def test_tunnels(state: SidecarState, host: str, port: int, code: str | None) -> None:
    refusal = decide_tunnel(CATALOG, state, host, port, T0 + 10, MONO + 1)
    assert (refusal.code if refusal else None) == code


@pytest.mark.parametrize(("state", "decision", "code", "outcome"), [
    (STATE, "approved", None, "refused"),
    (revoked(), "approved", codes.CHAIN_REVOKED, "refused"),  # revoked while it was held
    (STATE, "denied", codes.APPROVAL_DENIED, "refused"),
    (STATE, "timeout", codes.APPROVAL_TIMEOUT, "refused"),
    (STATE, "approval could not be requested: down", codes.APPROVAL_TIMEOUT, "refused"),
    (commanded("drain"), "cancelled", codes.DRAINING, "cancelled_not_sent"),
    (commanded("terminated"), "cancelled", codes.TERMINATED, "cancelled_not_sent"),
])
def test_after_approval(state: SidecarState, decision: str, code: str | None, outcome: str) -> None:
    refusal, resolution = after_approval(decision, state, "files.write", T0 + 10, MONO + 1)
    assert (refusal.code if refusal else None, resolution) == (code, outcome)


# -- properties -----------------------------------------------------------------------------------------
PROPERTY = settings(max_examples=150, deadline=None)
REQUESTS = st.one_of(
    st.builds(lambda m, p: facts(m, p), st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH"]),
              st.sampled_from(["/files/a", "/files/b/c", "/list", "/mcp", "/other"])),
    st.builds(lambda tools: rpc(*[call(t, i) for i, t in enumerate(tools)], batch=True),
              st.lists(st.sampled_from(["send", "read", "delete", "x", "nope"]), min_size=1, max_size=4)),
    st.builds(lambda tool: rpc(call(tool)), st.sampled_from(["send", "read", "delete", "x"])),
)
GRANT_SETS = st.dictionaries(st.sampled_from(CAPS), st.sampled_from(["direct", "approval"]), min_size=1)


@PROPERTY
@given(grants=GRANT_SETS, request_facts=REQUESTS)
def test_never_lets_go_what_the_chain_does_not_grant(grants: dict[str, str], request_facts: Facts) -> None:
    state = chain_state(grants)
    answer = decide(CATALOG, state, request_facts)
    if isinstance(answer, (Allow, Hold)):
        named = answer.tools or ((answer.capability,) if answer.capability else ())
        assert all(grants.get(c) in ("direct", "approval") for c in named), answer
        if not named:  # MCP plumbing: some tool on that server is granted
            tools = CATALOG.mcp_tools(answer.server or "")
            assert any(c in grants for caps in tools.values() for c in caps)
        assert isinstance(answer, Hold) == any(grants.get(c) == "approval" for c in named)


@PROPERTY
@given(grants=GRANT_SETS, request_facts=REQUESTS,
       how=st.sampled_from(["revoked", "expired", "early", "lease", "drain", "abort", "terminated"]),
       late=st.floats(0, 10_000))
def test_never_lets_anything_go_when_the_chain_state_forbids(grants: dict[str, str], request_facts: Facts, how: str,
                                                            late: float) -> None:
    state = chain_state(grants)
    at = {"now": request_facts.now, "now_mono": request_facts.now_mono}
    if how == "revoked":
        state.revoke([state.chain.jtis[0]], MONO)
    elif how == "expired":
        at["now"] = T0 + TTL + 30 + late
    elif how == "early":
        at["now"] = T0 - 30.001 - late
    elif how == "lease":
        at["now_mono"] = MONO + 15 + late
    elif how == "terminated":
        state.commanded({"termination_id": "t", "mode": "drain"})
        state.quiesced()
    else:
        state.commanded({"termination_id": "t", "mode": how})
    answer = decide(CATALOG, state, replace(request_facts, **at))
    assert isinstance(answer, Refused), answer
    assert decide_tunnel(CATALOG, state, "files.example", 443, at["now"], at["now_mono"]) is not None
    assert after_approval("approved", state, None, at["now"], at["now_mono"])[0] is not None
