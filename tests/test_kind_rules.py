"""The shipped kinds' matching, pinned against the rules docs/catalog.md states, not against older code.

Over generated catalogs, grants and requests, ``decide`` answers as the documented rules say, each rule written
here again from the page, as plainly as it reads:

* ``http``: a request falls under a capability when its host is the capability's (case-insensitively), its port
  is the capability's (any port when none is named), its method is listed and its path (without the query)
  matches the glob (``*`` any run of characters, ``/`` included; the rest literal). Of the capabilities it falls
  under, the one granted at the best tier answers (direct, then approval; the first in the catalog among equals):
  direct is allowed, approval held, absent refused ``tether.capability_absent`` naming it. A request that falls
  under none is refused ``tether.capability_absent`` on a host and port the catalog names, and
  ``tether.unknown_destination`` elsewhere. While the chain drains, every request is refused ``tether.draining``
  (naming what it fell under).
* ``mcp``: a request to an MCP endpoint is the endpoint's, whatever http capability its request line also falls
  under. A JSON-RPC POST leaves only when every message in it is granted: ``tools/call`` its tool, ``prompts/get``
  its prompt, ``logging/setLevel`` the server's logging; the session's plumbing (``initialize``, the lists,
  notifications) needs any item on that server granted; any other method is refused. It is held when an item it
  uses is granted at approval tier, and each item used is one unit of its budget (``tools``, in message order).
  A GET (the server's stream) needs something on the server granted; other methods are refused.

Pure: no sockets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.capability import errors as codes
from tether.capability import keys
from tether.capability.catalog import Catalog, catalog_from
from tether.capability.chain import Verifier, mint_root
from tether.capability.decision import Allow, Decision, Facts, Hold, Refused
from tether.proxy.decision import decide
from tether.proxy.state import SidecarState

TRUST, AGENT_KEY = keys.generate(), keys.generate()
T0, MONO = 1_750_000_000.0, 1000.0
RULES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain_for(catalog: Catalog, grants: Mapping[str, str], drain: bool) -> SidecarState:
    wire = mint_root(TRUST, agent="agent-1", subject_key=AGENT_KEY.public_key(), caps=dict(grants), now=T0,
                     ttl_s=3600, depth=0, catalog=catalog)
    verifier = Verifier(TRUST.public_key(), catalog_hash=catalog.hash, leeway=30)
    state = SidecarState(verifier.verify(wire, now=T0), verifier, lease_ttl_s=15.0)
    state.renewed(MONO)
    if drain:
        state.commanded({"termination_id": "t1", "mode": "drain"})
    return state


def facts(method: str, host: str, port: int, path: str, body: bytes | None = None) -> Facts:
    return Facts(method=method, sent_method=method, host=host, port=port, path=path,
                 url=f"http://{host}:{port}{path.split('?', 1)[0]}", now=T0 + 10, now_mono=MONO + 1, body=body)


def grants_for(catalog: Catalog) -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(st.sampled_from(sorted(catalog.names())), st.sampled_from(["direct", "approval"]),
                           min_size=1)


def best_of(names: list[str], grants: Mapping[str, str]) -> tuple[str, str]:
    """The documented choice among the capabilities a request falls under (``names`` in catalog order)."""
    for tier in ("direct", "approval"):
        for name in names:
            if grants.get(name) == tier:
                return name, tier
    return names[0], "absent"


def said(answer: Decision) -> tuple[Any, ...]:
    code = answer.refusal.code if isinstance(answer, Refused) else None
    return type(answer).__name__, answer.capability, answer.tier, code


# -- http -----------------------------------------------------------------------------------------------------
HOSTS = ["a.example", "b.example", "127.0.0.1"]
GLOBS = ["/files/*", "/files/a", "/*", "/x/*/y", "/", "/files*", "/*/c"]
PATHS = ["/files/a", "/files/b/c", "/", "/x/1/y", "/x/y", "/other", "/files", "/filesx", "/files/a?q=1", "/b/c"]
METHODS = ["GET", "POST", "PUT", "DELETE"]

http_caps = st.dictionaries(
    st.from_regex(r"[a-z]{1,3}\.[a-z]{1,3}", fullmatch=True),
    st.fixed_dictionaries({"host": st.sampled_from([*HOSTS, "A.Example"]),
                           "methods": st.lists(st.sampled_from(METHODS), min_size=1, max_size=3, unique=True),
                           "path": st.sampled_from(GLOBS)},
                          optional={"port": st.sampled_from([80, 8080])}),
    min_size=1, max_size=6)


def glob_matches(glob: str, path: str) -> bool:
    return re.fullmatch(".*".join(re.escape(part) for part in glob.split("*")), path, re.S) is not None


def http_rule(catalog: Catalog, raw: Mapping[str, Any], grants: Mapping[str, str], drain: bool,
              request: Facts) -> tuple[Any, ...]:
    """What docs/catalog.md says an http request is answered (``raw``: the capabilities as written). A drained
    chain's refusal still names what the request fell under."""
    path = request.path.split("?", 1)[0]
    reaches = [name for name in catalog.capabilities if raw[name]["host"].lower() == request.host
               and raw[name].get("port", request.port) == request.port]
    under = [name for name in reaches if request.method in raw[name]["methods"]
             and glob_matches(raw[name]["path"], path)]
    if not under:
        return "Refused", None, None, codes.DRAINING if drain else codes.CAPABILITY_ABSENT if reaches else \
            codes.UNKNOWN_DESTINATION
    name, tier = best_of(under, grants)
    if drain:
        return "Refused", name, tier, codes.DRAINING
    if tier == "absent":
        return "Refused", name, tier, codes.CAPABILITY_ABSENT
    return ("Allow" if tier == "direct" else "Hold"), name, tier, None


@RULES
@given(raw=http_caps, data=st.data())
def test_an_http_request_is_answered_as_the_catalog_page_says(raw: dict[str, Any], data: st.DataObject) -> None:
    catalog = catalog_from({"capabilities": {name: {"http": match} for name, match in raw.items()}})
    grants = data.draw(grants_for(catalog))
    drain = data.draw(st.sampled_from([False, False, False, True]))
    state = chain_for(catalog, grants, drain)
    for _ in range(6):
        request = facts(data.draw(st.sampled_from(METHODS)), data.draw(st.sampled_from([*HOSTS, "c.example"])),
                        data.draw(st.sampled_from([80, 8080, 443])), data.draw(st.sampled_from(PATHS)))
        assert said(decide(catalog, state, request)) == http_rule(catalog, raw, grants, drain, request), request


def test_the_http_rule_is_not_vacuous() -> None:
    """Each answer the rule can give is reached by a plain table (so the property above compares answers of
    every kind): allowed, held, refused absent, refused on a known host, an unknown destination."""
    raw = {"read": {"host": "a.example", "methods": ["GET"], "path": "/files/*"},
           "write": {"host": "a.example", "methods": ["PUT"], "path": "/files/*", "port": 80},
           "drop": {"host": "a.example", "methods": ["DELETE"], "path": "/*"}}
    catalog = catalog_from({"capabilities": {name: {"http": match} for name, match in raw.items()}})
    grants = {"read": "direct", "write": "approval"}
    state = chain_for(catalog, grants, False)
    table = [(facts("GET", "a.example", 80, "/files/a/b"), ("Allow", "read", "direct", None)),
             (facts("PUT", "a.example", 80, "/files/a"), ("Hold", "write", "approval", None)),
             (facts("PUT", "a.example", 8080, "/files/a"), ("Refused", None, None, codes.CAPABILITY_ABSENT)),
             (facts("DELETE", "a.example", 80, "/x"), ("Refused", "drop", "absent", codes.CAPABILITY_ABSENT)),
             (facts("GET", "a.example", 80, "/other"), ("Refused", None, None, codes.CAPABILITY_ABSENT)),
             (facts("GET", "b.example", 80, "/files/a"), ("Refused", None, None, codes.UNKNOWN_DESTINATION))]
    for request, expected in table:
        assert said(decide(catalog, state, request)) == expected == http_rule(catalog, raw, grants, False, request)


# -- mcp ------------------------------------------------------------------------------------------------------
SERVER = "http://mcp.example:80/mcp"
TOOLS = ["send", "read", "x"]
PROMPTS = ["brief", "x"]
PLUMBING = ["initialize", "tools/list", "notifications/initialized"]
RPC = ["tools/call", "prompts/get", "logging/setLevel", *PLUMBING, "bogus/method"]

mcp_items = st.one_of(st.builds(lambda t: {"tool": t}, st.sampled_from(TOOLS)),
                      st.builds(lambda p: {"prompt": p}, st.sampled_from(PROMPTS)),
                      st.just({"logging": True}))
mcp_caps = st.dictionaries(st.from_regex(r"[a-z]{1,3}\.[a-z]{1,3}", fullmatch=True), mcp_items, min_size=1,
                           max_size=6)
messages = st.lists(st.tuples(st.sampled_from(RPC), st.sampled_from([*TOOLS, *PROMPTS])), min_size=1, max_size=3)


def rpc_body(msgs: list[tuple[str, str]], batch: bool) -> bytes:
    def one(i: int, method: str, name: str) -> dict[str, Any]:
        if method.startswith("notifications/"):
            return {"jsonrpc": "2.0", "method": method}
        params = {"tools/call": {"name": name, "arguments": {}}, "prompts/get": {"name": name},
                  "logging/setLevel": {"level": "info"}}.get(method, {})
        return {"jsonrpc": "2.0", "id": i, "method": method, "params": params}

    items = [one(i, m, n) for i, (m, n) in enumerate(msgs)]
    return json.dumps(items if batch or len(items) > 1 else items[0]).encode()


def mcp_rule(catalog: Catalog, raw: Mapping[str, Any], grants: Mapping[str, str], drain: bool,
             msgs: list[tuple[str, str]]) -> tuple[Any, ...]:
    """What docs/catalog.md says a JSON-RPC POST to the server is answered: (answer, items used, refusal code)."""
    order = [name for name in catalog.capabilities if name in raw]
    anything = any(grants.get(name) for name in order)
    used: list[tuple[str, str]] = []
    for method, name in msgs:
        if method in PLUMBING:
            if not anything:
                return "Refused", None, codes.CAPABILITY_ABSENT
            continue
        kind, value = {"tools/call": ("tool", name), "prompts/get": ("prompt", name),
                       "logging/setLevel": ("logging", True)}.get(method, (None, None))
        names = [cap for cap in order if kind is not None and raw[cap].get(kind) == value]
        if not names:
            return "Refused", None, codes.CAPABILITY_ABSENT
        cap, tier = best_of(names, grants)
        if tier == "absent":
            return "Refused", None, codes.CAPABILITY_ABSENT
        used.append((cap, tier))
    if drain:
        return "Refused", None, codes.DRAINING
    if not used:
        return "Allow", None, None
    return ("Hold" if any(t == "approval" for _, t in used) else "Allow"), tuple(c for c, _ in used), None


@RULES
@given(raw=mcp_caps, data=st.data())
def test_an_mcp_request_is_answered_as_the_catalog_page_says(raw: dict[str, Any], data: st.DataObject) -> None:
    # An http capability on the endpoint's own request line: the endpoint's rules answer all the same.
    web = {"web.mcp": {"http": {"host": "mcp.example", "methods": ["GET", "POST", "PUT"], "path": "/mcp*"}}}
    catalog = catalog_from({"capabilities": {**{n: {"mcp": {"url": SERVER, **item}} for n, item in raw.items()},
                                             **web}})
    grants = data.draw(grants_for(catalog))
    drain = data.draw(st.sampled_from([False, False, False, True]))
    state = chain_for(catalog, grants, drain)
    for _ in range(4):
        msgs = data.draw(messages)
        answer = decide(catalog, state, facts("POST", "mcp.example", 80, "/mcp", rpc_body(msgs, data.draw(
            st.booleans()))))
        code = answer.refusal.code if isinstance(answer, Refused) else None
        assert answer.server == SERVER, answer
        assert (type(answer).__name__, answer.tools, code) == mcp_rule(catalog, raw, grants, drain, msgs), msgs
        if isinstance(answer, Allow | Hold) and answer.tools:
            assert answer.capability == ",".join(dict.fromkeys(answer.tools))
    anything = any(grants.get(name) for name in raw)
    stream = decide(catalog, state, facts("GET", "mcp.example", 80, "/mcp"))
    expected = codes.DRAINING if drain else None if anything else codes.CAPABILITY_ABSENT
    assert (stream.refusal.code if isinstance(stream, Refused) else None) == expected, stream
    put = decide(catalog, state, facts("PUT", "mcp.example", 80, "/mcp"))
    assert isinstance(put, Refused) and put.server == SERVER  # not the http capability's, though it lists PUT
    assert put.refusal.code == (codes.DRAINING if drain else codes.CAPABILITY_ABSENT)


def test_the_mcp_rule_is_not_vacuous() -> None:
    raw = {"mail.send": {"tool": "send"}, "mail.read": {"tool": "read"}, "brief": {"prompt": "brief"}}
    catalog = catalog_from({"capabilities": {n: {"mcp": {"url": SERVER, **item}} for n, item in raw.items()}})
    grants = {"mail.send": "approval", "mail.read": "direct"}
    state = chain_for(catalog, grants, False)
    table = [([("tools/call", "read")], ("Allow", ("mail.read",), None)),
             ([("tools/call", "read"), ("tools/call", "send")], ("Hold", ("mail.read", "mail.send"), None)),
             ([("initialize", "")], ("Allow", None, None)),
             ([("prompts/get", "brief")], ("Refused", None, codes.CAPABILITY_ABSENT)),
             ([("tools/call", "read"), ("bogus/method", "")], ("Refused", None, codes.CAPABILITY_ABSENT))]
    for msgs, expected in table:
        answer = decide(catalog, state, facts("POST", "mcp.example", 80, "/mcp", rpc_body(msgs, False)))
        code = answer.refusal.code if isinstance(answer, Refused) else None
        assert (type(answer).__name__, answer.tools, code) == expected == mcp_rule(catalog, raw, grants, False,
                                                                                   msgs), msgs
