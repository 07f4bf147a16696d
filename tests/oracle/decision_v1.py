from __future__ import annotations  # noqa
"""FROZEN ORACLE, not product code: tether/proxy/decision.py as it was before the sidecar's matching went behind
the capability-kind registry (issue 25), imports made absolute. tests/test_kind_matching.py checks the new
decision against it. Do not edit."""
# ruff: noqa
"""The enforcement decision, pure: catalog + chain state + call facts -> an answer. No I/O, no flows, no clock.

``decide`` answers for one request as the agent sent it: ``Allow`` (forward it once the final look, the budget
and the write-ahead record let it leave), ``Hold`` (a person decides first), ``ReadBody`` (a JSON-RPC POST to
an MCP server: decide again once its body is here) or ``Refused`` with a ``Refusal`` that carries a stable
code from docs/contract.md section 5. Every answer also says what the call matched (capability, tier, MCP server),
for the report and for the error body. ``decide_tunnel`` answers for a CONNECT, ``after_approval`` for a held
call once the person's decision (or its absence) is known.

The facts come from the edge (tether/proxy/enforce.py reads them off a mitmproxy flow); the time comes in with them.
"""


import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote, unquote_to_bytes

from tether.capability import errors as codes
from tests.oracle.catalog_v1 import Catalog
from tether.capability.errors import TetherError
from tether.capability.events import APPROVED, CANCELLED, DENIED

from tether.proxy import mcp

HTTP_STATUS = {
    codes.CAPABILITY_ABSENT: 403,
    codes.UNKNOWN_DESTINATION: 403,
    codes.CHAIN_INVALID: 403,
    codes.CHAIN_REVOKED: 403,
    codes.CHAIN_EXPIRED: 403,
    codes.LEASE_EXPIRED: 503,
    codes.DRAINING: 503,
    codes.STOPPING: 503,
    codes.TERMINATED: 503,
    codes.APPROVAL_DENIED: 403,
    codes.APPROVAL_TIMEOUT: 403,
    codes.CAPTURE_UNAVAILABLE: 503,
    codes.SPOOL_UNAVAILABLE: 503,
    codes.CREDENTIAL_UNAVAILABLE: 503,
    codes.BUDGET_EXHAUSTED: 429,
    codes.RATE_LIMITED: 429,
    codes.BAD_REQUEST: 400,
}

# Headers that frameworks and front proxies (IIS URL Rewrite, Symfony, Laravel, Spring, Express method-override,
# Rails, Envoy, nginx setups ...) honour to serve another path, method, host or scheme than the request line
# names. Refused rather than stripped: stripping would silently change what the agent asked for, and a request
# that needs one is not the one tether matched. docs/threat-model.md lists them.
REWRITE_HEADERS = ("x-original-url", "x-rewrite-url", "x-http-method-override", "x-http-method",
                   "x-method-override", "x-forwarded-host", "x-forwarded-prefix", "forwarded",
                   "x-forwarded-uri", "x-forwarded-path", "x-original-uri", "x-original-path", "x-envoy-original-path",
                   "x-original-method", "x-forwarded-method", "x-original-host", "x-host", "x-forwarded-server",
                   "x-forwarded-proto", "x-forwarded-scheme", "x-forwarded-port", "x-forwarded-ssl",
                   "x-url-scheme", "front-end-https")
# CGI, WSGI, PHP and Rack read a header's name with "-" and "_" alike (X_Original_URL is HTTP_X_ORIGINAL_URL,
# as X-Original-URL is): an underscore spelling of a header tether reads, refuses or that frames the request is
# refused too. Only names with a dash have another spelling.
SPELLED_HEADERS = frozenset({*(n for n in REWRITE_HEADERS if "-" in n), "tether-chain", "mcp-method", "mcp-name",
                             "mcp-session-id", "mcp-protocol-version", "content-length", "transfer-encoding",
                             "content-encoding", "content-type", "proxy-connection", "proxy-authorization",
                             "keep-alive", "last-event-id"})
# Query parameters that the same frameworks read as the method (Laravel and Symfony ``_method``, Rails and
# Rack::MethodOverride ``_method``, Salesforce-style ``_HttpMethod``, some ``X-HTTP-Method-Override`` as a
# parameter). Names compared case-insensitively, after percent-decoding.
METHOD_PARAMS = frozenset({"_method", "__method", "_httpmethod", "x-http-method-override", "x-http-method",
                           "x-method-override", "http-method-override"})
# Characters in a path (after percent-decoding) that a server may fold into "/" or "." but Unicode's NFKC does
# not (so the catalog's own check does not see them), and characters nobody can see: format characters
# (Unicode category Cf: zero-width spaces and joiners, bidi controls, the soft hyphen, the BOM) are refused
# whatever their code point.
FOLDING_CHARS = frozenset("\u2215\u2044\u29f8\u29f9\u29f5\u2216\ufe68\u3002\uff61\ufe52\u2024\u0338\u2afd"
                          "\u2571\u2572\u27cb\u27cd\u1735")
_METHOD = re.compile(r"[A-Z]{1,16}")
_RANK = {"direct": 0, "approval": 1}


class Refusal(TetherError):
    """A call tether refuses; nothing was sent upstream."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message, code=code, **details)
        self.http_status = HTTP_STATUS.get(code, 403)


class ChainState(Protocol):
    """What the decision reads of the sidecar's state (``proxy.state.SidecarState``)."""

    mode: str

    @property
    def agent(self) -> str: ...

    @property
    def wire(self) -> str: ...

    def tier(self, capability: str) -> str: ...

    def refusal(self, now: float, now_mono: float) -> Refusal | None: ...


# Facts and answers are built once per call on the sidecar's hot path and never changed after: plain slotted
# dataclasses, not frozen ones (a frozen dataclass's __init__ costs three times as much).
@dataclass(slots=True, kw_only=True)
class Facts:
    """One request as the agent sent it, and when: everything ``decide`` reads."""

    method: str  # as matched: upper-cased
    sent_method: str  # as sent (methods are case-sensitive)
    host: str
    port: int
    path: str  # the request target, query included
    url: str  # scheme://host:port/path, no query: the call's URL
    now: float
    now_mono: float
    rewrite_headers: tuple[str, ...] = ()  # those of REWRITE_HEADERS the request carries, in that order
    malformed_field: str | None = None  # the first header field RFC 9112 does not allow (obs-fold, CR, LF ...)
    spelled_headers: tuple[str, ...] = ()  # underscore spellings of SPELLED_HEADERS, as sent
    upgrade: bool = False
    websocket: bool = False  # the upgrade asked for is a websocket (Upgrade: websocket on a GET)
    chain_header: str | None = None  # Tether-Chain
    host_header: str | None = None  # Host, or :authority
    mcp_method: str | None = None  # the mcp-method header
    mcp_name: str | None = None  # the mcp-name header
    content_encoding: str | None = None
    body: bytes | None = None  # None until the body is here


@dataclass(slots=True, kw_only=True)
class Answer:
    capability: str | None = None  # what the call matched (several, comma-joined, for a batch of item uses)
    tier: str | None = None
    server: str | None = None  # the MCP endpoint, when the call goes to one
    detail: str | None = None  # for the report: which MCP plumbing it was
    tools: tuple[str, ...] | None = None  # the capabilities a JSON-RPC body's messages use (tools, resources,
    #                                       prompts, plumbing): one budget unit each; the name it had for tools only
    parsed: mcp.Parsed | None = None  # the JSON-RPC body, once read
    callers: dict[str, str] | None = None  # each tools/call request's capability, by its id (mcp.id_key): a task
    #                                        the call creates belongs to it, in a batch too


@dataclass(slots=True, kw_only=True)
class Allow(Answer):
    pass


@dataclass(slots=True, kw_only=True)
class Hold(Answer):
    pass


@dataclass(slots=True, kw_only=True)
class ReadBody(Answer):
    pass


@dataclass(slots=True, kw_only=True)
class Refused(Answer):
    refusal: Refusal


Decision = Allow | Hold | ReadBody | Refused


def decide(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision:
    """The answer for one request: see the module docstring."""
    refusal = _request_line(facts)
    if refusal is not None:
        return Refused(refusal=refusal)
    server = catalog.mcp_server(facts.url)
    if server is not None and facts.method == "POST":
        if facts.body is None:
            return ReadBody(server=server)
        return _decide_rpc(catalog, chain, facts, server)
    names = catalog.match_http(facts.host, facts.port, facts.method, facts.path)
    capability, tier = _best(chain, names) if names else (None, None)
    websocket_ok = capability is not None and _websocket_capability(catalog, capability)
    refusal = _state_and_headers(chain, facts, websocket_ok=websocket_ok and server is None)
    if refusal is None and server is not None:
        return _decide_stream(catalog, chain, facts, server, capability, tier)
    if refusal is None and not names:
        refusal = (Refusal(codes.CAPABILITY_ABSENT, f"no capability covers {facts.method} {facts.path} on {facts.host}")
                   if catalog.knows_host(facts.host, facts.port) else _unknown(facts.host, facts.port))
    if refusal is None and tier == "absent":
        refusal = Refusal(codes.CAPABILITY_ABSENT, f"{capability} is not granted to {chain.agent}")
    if refusal is not None:
        return Refused(refusal=refusal, capability=capability, tier=tier, server=server)
    return (Hold if tier == "approval" else Allow)(capability=capability, tier=tier)


def decide_tunnel(catalog: Catalog, chain: ChainState, host: str, port: int, now: float,
                  now_mono: float) -> Refusal | None:
    """May a CONNECT open a tunnel? Only to a destination in the catalog, and only while calls may leave."""
    if not catalog.knows_host(host, port):
        return _unknown(host, port)
    return chain.refusal(now, now_mono)  # a terminated agent opens no tunnel


def after_approval(decision: str, chain: ChainState, capability: str | None, now: float,
                   now_mono: float) -> tuple[Refusal | None, str]:
    """A held call once its approval was decided: (the refusal or None, the resolution a refusal gets)."""
    if decision == APPROVED:
        return chain.refusal(now, now_mono), "refused"
    if decision == DENIED:
        return Refusal(codes.APPROVAL_DENIED, f"a person denied {capability} for this call"), "refused"
    if decision == CANCELLED:
        return Refusal(codes.TERMINATED if chain.mode == "terminated" else codes.DRAINING,
                       "the held call was cancelled: this agent is being terminated"), "cancelled_not_sent"
    return Refusal(codes.APPROVAL_TIMEOUT, f"no approval for {capability} arrived in time ({decision})"), "refused"


# -- the parts ------------------------------------------------------------------------------------------
def _unknown(host: str, port: int) -> Refusal:
    return Refusal(codes.UNKNOWN_DESTINATION, f"{host}:{port} is not a destination in the capability catalog")


def _best(chain: ChainState, names: list[str]) -> tuple[str, str]:
    ranked = sorted(names, key=lambda n: _RANK.get(chain.tier(n), 2))
    return ranked[0], chain.tier(ranked[0])


def _request_line(facts: Facts) -> Refusal | None:
    """The server must read the method and path tether matched, and nothing that rewrites them."""
    if not facts.path.startswith("/"):
        return Refusal(codes.CAPABILITY_ABSENT, f"the request target {facts.path[:64]!r} is not a path (asterisk "
                       "or authority form); only requests for a path are forwarded", reason="request_target")
    if "#" in facts.path:
        return Refusal(codes.CAPABILITY_ABSENT, "a request target never carries a fragment ('#'); servers "
                       "disagree on what follows it, so it is not forwarded", reason="request_target")
    if not _METHOD.fullmatch(facts.sent_method):
        # Methods are case-sensitive (RFC 9110): "get" is not GET, though some servers treat it as GET, and
        # the catalog matched the upper-cased name.
        return Refusal(codes.CAPABILITY_ABSENT, f"the method {facts.sent_method[:32]!r} is not an upper-case HTTP "
                       "method; send it as the catalog names it", reason="method")
    if facts.malformed_field is not None:
        return Refusal(codes.BAD_REQUEST, f"the header field {facts.malformed_field} is not allowed by RFC 9112 "
                       "(obs-fold continuation lines, CR, LF or NUL in a value, a name that is not a token); "
                       "servers read such fields differently, so the request is not forwarded",
                       reason="malformed_field")
    if facts.rewrite_headers:
        return Refusal(codes.CAPABILITY_ABSENT, f"the header {facts.rewrite_headers[0]} asks the server to use "
                       "another path, method or host than the one tether matched; remove it", reason="rewrite_header")
    if facts.spelled_headers:
        return Refusal(codes.CAPABILITY_ABSENT, f"the header {facts.spelled_headers[0]} is another spelling of "
                       f"{facts.spelled_headers[0].lower().replace('_', '-')} to CGI, WSGI and PHP servers; send the "
                       "dashed name, or none", reason="underscore_header")
    param = _method_param(facts.path)
    if param is not None:
        return Refusal(codes.CAPABILITY_ABSENT, f"the query parameter {param!r} asks the server to use another "
                       f"method than {facts.sent_method}; remove it", reason="method_override_param")
    char = _folding_char(facts.path)
    if char is not None:
        return Refusal(codes.CAPABILITY_ABSENT, f"the path holds U+{ord(char):04X} "
                       f"({unicodedata.name(char, 'unnamed')}), which servers may read as '/' or '.' or not at all; "
                       "it is not forwarded", reason="path_character")
    return None


def _method_param(path: str) -> str | None:
    """The first query parameter that overrides the method (``METHOD_PARAMS``), as sent; None when none does."""
    _, sep, query = path.partition("?")
    if not sep:
        return None
    for pair in re.split(r"[&;]", query):
        name = pair.split("=", 1)[0]
        if unquote(unquote(name.replace("+", " "))).strip().lower() in METHOD_PARAMS:
            return name
    return None


_FORM = "application/x-www-form-urlencoded"
_MULTIPART_FIELD = re.compile(rb'content-disposition:[^\r\n]*;\s*name="?([^";\r\n]+)"?[^\r\n]*\r\n(?:[^\r\n]+\r\n)*'
                              rb"\r\n([^\r\n]*)\r\n", re.IGNORECASE)


def body_override(content_type: str | None, body: bytes) -> tuple[str, str] | None:
    """The first method-override field a body carries (``METHOD_PARAMS``), as (field as sent, method upper-cased);
    None when it carries none. Read as frameworks read it: a form-encoded body (Rails, Rack, Symfony, Laravel), a
    multipart form's field, a JSON object's top-level key (Laravel reads its input, JSON included). Names are
    compared decoded (a form's percent-encoding, a JSON string's escapes), so a JSON body is parsed only when it
    holds the word or an escape, and a form always."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    is_json = media == "application/json" or media.endswith("+json")
    if not body or (is_json and b"\\u" not in body and b"method" not in body.lower()):
        return None
    pairs: list[tuple[str, str]] = []
    if media == _FORM:
        text = body.decode("latin-1")
        for pair in re.split(r"[&;]", text):
            name, _, value = pair.partition("=")
            pairs.append((name, unquote(unquote(value.replace("+", " ")))))
    elif media == "multipart/form-data":
        pairs = [(m.group(1).decode("latin-1"), m.group(2).decode("latin-1")) for m in _MULTIPART_FIELD.finditer(body)]
    elif is_json:
        try:
            value = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None  # not JSON to the server either
        if isinstance(value, dict):
            pairs = [(k, v) for k, v in value.items() if isinstance(v, str)]
    for name, value in pairs:
        if unquote(unquote(name.replace("+", " "))).strip().lower() in METHOD_PARAMS:
            return name, value.strip().upper()
    return None


def override_refusal(catalog: Catalog, facts: Facts, capability: str | None,
                     override: tuple[str, str]) -> Refusal | None:
    """A body's method override passes only when the capability the call matched grants that method on that path
    too (then the server does what the capability allows, at its tier and budget); otherwise refused."""
    name, method = override
    if capability is not None and _METHOD.fullmatch(method) and capability in catalog.match_http(
            facts.host, facts.port, method, facts.path):
        return None
    return Refusal(codes.CAPABILITY_ABSENT, f"the body field {name!r} asks the server to use the method "
                   f"{method[:16]!r}, which {capability or 'no capability'} does not grant on this path; remove it",
                   reason="method_override_body")


def _folding_char(path: str) -> str | None:
    """A character of ``FOLDING_CHARS`` or of category Cf in the path, at any depth of percent-encoding."""
    text = path.split("?", 1)[0]
    for _ in range(4):
        for ch in text:
            if ord(ch) > 0x7F and (ch in FOLDING_CHARS or unicodedata.category(ch) == "Cf"):
                return ch
        deeper = unquote_to_bytes(text).decode("utf-8", "replace")
        if deeper == text:
            return None
        text = deeper
    return None


def _websocket_capability(catalog: Catalog, name: str) -> bool:
    cap = catalog.capabilities.get(name)
    return cap is not None and cap.http is not None and cap.http.websocket


def _state_and_headers(chain: ChainState, facts: Facts, *, websocket_ok: bool = False) -> Refusal | None:
    """May anything leave now, and do the headers say what the connection does?"""
    refusal = chain.refusal(facts.now, facts.now_mono)
    if refusal is not None:
        return refusal
    if facts.websocket and facts.method == "GET" and websocket_ok:
        pass  # a websocket the capability grants: the connection is the call (tracked, drained, cut, captured)
    elif facts.websocket:
        return Refusal(codes.CAPABILITY_ABSENT, "no capability here grants a websocket (an http capability takes "
                       "websocket: true)", reason="websocket")
    elif facts.upgrade or facts.method == "CONNECT":
        # Another upgraded stream (h2c, a tunnel in a tunnel) would outlive the call's decision (and a
        # revocation, drain or abort) unseen: tether does not let one start.
        return Refusal(codes.CAPABILITY_ABSENT, "protocol upgrades other than granted websockets (h2c, tunnels in "
                       "tunnels) are not forwarded")
    if facts.chain_header is not None and facts.chain_header.strip() != chain.wire:
        return Refusal(codes.CHAIN_INVALID, "the request carries a Tether-Chain that is not this sidecar's; "
                       "an agent cannot borrow another chain", reason="foreign_chain")
    host_header = facts.host_header
    if host_header:
        name, port = host_header, None
        if not host_header.endswith("]") and ":" in host_header:
            name, _, port = host_header.rpartition(":")
        same_port = port is None or (port.isdigit() and int(port) == facts.port)
        if name.strip("[]").lower().rstrip(".") != facts.host.lower().rstrip(".") or not same_port:
            return Refusal(codes.UNKNOWN_DESTINATION,
                           f"Host header {host_header!r} does not name the destination {facts.host}:{facts.port}")
    return None


def _plumbing(catalog: Catalog, chain: ChainState, server: str) -> Refusal | None:
    """Session plumbing needs some item (a tool, resource, prompt or piece of plumbing) granted on that server."""
    if any(chain.tier(c) != "absent" for c in catalog.mcp_capabilities(server)):
        return None
    return Refusal(codes.CAPABILITY_ABSENT, f"nothing on {server} is granted to {chain.agent}")


@dataclass(slots=True)
class _Need:
    """One item a message needs: the capabilities that could grant it, what to call it in a refusal, and
    whether the message uses it (held at approval tier, one unit of its budget) or only needs it to exist
    (the end of a subscription, the prompt or resource a completion is about)."""

    names: list[str]
    label: str
    uses: bool = True
    fallback: str | None = None  # the capability a report names when the catalog has none for it


def _needs(catalog: Catalog, server: str, message: mcp.Message) -> list[_Need] | None:
    """What one message needs granted, or None when it is not an item's method (plumbing, or unknown)."""
    method = message.method
    if method == "tools/call":
        return [_Need(catalog.match_mcp_item(server, "tool", message.tool or ""), f"tool {message.tool!r}",
                      fallback=f"mcp:{message.tool}")]
    if method == "prompts/get":
        return [_Need(catalog.match_mcp_item(server, "prompt", message.prompt or ""), f"prompt {message.prompt!r}")]
    if method == "resources/read":
        return [_Need(catalog.match_resource(server, message.uri or ""), f"resource {message.uri!r}")]
    if method in ("resources/subscribe", "resources/unsubscribe"):
        ending = method == "resources/unsubscribe"  # ending a subscription is never held, never counted
        return [_Need(catalog.match_resource(server, message.uri or ""), f"resource {message.uri!r}", uses=False),
                _Need(catalog.match_mcp_item(server, "subscriptions"), f"subscriptions on {server}", uses=not ending)]
    if method == mcp.LISTEN:
        if not message.uris:
            return None  # list-changed notifications only: plumbing, as the GET listen stream is
        return [*(_Need(catalog.match_resource(server, uri), f"resource {uri!r}", uses=False) for uri in message.uris),
                _Need(catalog.match_mcp_item(server, "subscriptions"), f"subscriptions on {server}")]
    if method == "logging/setLevel":
        return [_Need(catalog.match_mcp_item(server, "logging"), f"logging on {server}")]
    if method == "completion/complete":
        if message.prompt is not None:
            about = _Need(catalog.match_mcp_item(server, "prompt", message.prompt), f"prompt {message.prompt!r}",
                          uses=False)
        else:
            about = _Need(catalog.match_resource_template(server, message.uri or ""), f"resource {message.uri!r}",
                          uses=False)
        return [_Need(catalog.match_mcp_item(server, "completion"), f"completion on {server}"), about]
    return None


def _decide_stream(catalog: Catalog, chain: ChainState, facts: Facts, server: str, capability: str | None,
                   tier: str | None) -> Decision:
    """A GET (the server's stream to the client) or DELETE (the session's end) on an MCP endpoint."""
    if facts.method not in ("GET", "DELETE"):
        refusal: Refusal | None = Refusal(codes.CAPABILITY_ABSENT,
                                          f"{facts.method} to an MCP endpoint is not in the catalog")
    else:
        refusal = _plumbing(catalog, chain, server)
    if refusal is not None:
        return Refused(refusal=refusal, capability=capability, tier=tier, server=server)
    return Allow(capability=capability, tier=tier, server=server, detail=f"mcp {facts.method}")


def _read_rpc(facts: Facts) -> mcp.Parsed | Refusal:
    try:
        # The server reads the bytes as sent: match those, and never a body we would have to decode.
        encoding = (facts.content_encoding or "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise mcp.NotJsonRpc(f"an encoded body (Content-Encoding: {encoding}) is not matched")
        return mcp.parse(facts.body or b"")
    except mcp.NotJsonRpc as exc:
        return Refusal(codes.CAPABILITY_ABSENT, f"not a JSON-RPC message tether can match: {exc}")


def _decide_rpc(catalog: Catalog, chain: ChainState, facts: Facts, server: str) -> Decision:
    """A JSON-RPC POST (one message or a batch): every message must be granted, or none leaves."""
    parsed = _read_rpc(facts)
    if isinstance(parsed, Refusal):
        return Refused(refusal=parsed, server=server)
    capability: str | None = None
    detail: str | None = None
    used: list[tuple[str, str]] = []  # (capability, tier) of every item a message uses: held, counted
    callers: dict[str, str] = {}
    refusal: Refusal | None = None
    for message in parsed.messages:
        needs = _needs(catalog, server, message)
        if needs is not None:
            for need in needs:
                name, tier = _best(chain, need.names) if need.names else (None, "absent")
                if tier == "absent":
                    capability = name or need.fallback
                    refusal = Refusal(codes.CAPABILITY_ABSENT, f"{need.label} is not granted to {chain.agent}",
                                      capability=capability)
                    break
                if need.uses:
                    used.append((name, tier))
                    if message.method == "tools/call" and message.id is not None and name is not None:
                        callers[mcp.id_key(message.id)] = name
            if refusal is not None:
                break
            if message.method != "tools/call":
                detail = f"mcp {message.method}"
        elif message.is_plumbing:
            refusal = _plumbing(catalog, chain, server)
            if refusal is not None:
                break
            detail = detail or f"mcp {message.method or 'response'}"
        else:
            refusal = Refusal(codes.CAPABILITY_ABSENT, f"MCP method {message.method!r} is not in the catalog")
            break
    refusal = refusal or _rpc_headers(facts, parsed) or _state_and_headers(chain, facts)
    if refusal is not None:
        if capability is None and used:
            capability = ",".join(dict.fromkeys(c for c, _ in used))
        return Refused(refusal=refusal, capability=capability, server=server, detail=detail, parsed=parsed)
    if not used:
        return Allow(server=server, detail=detail or "mcp", parsed=parsed)
    names = tuple(c for c, _ in used)
    held = any(t == "approval" for _, t in used)
    return (Hold if held else Allow)(capability=",".join(dict.fromkeys(names)), tier="approval" if held else "direct",
                                     server=server, detail=detail, tools=names, parsed=parsed, callers=callers)


def _rpc_headers(facts: Facts, parsed: mcp.Parsed) -> Refusal | None:
    """Servers may route on the mcp-method / mcp-name headers: they must say what the body says."""
    if parsed.batch:
        return None
    message = parsed.messages[0]
    if facts.mcp_method is not None and facts.mcp_method != message.method:
        return Refusal(codes.CAPABILITY_ABSENT, "the mcp-method header does not match the JSON-RPC body")
    if facts.mcp_name is not None and message.method in mcp.MIRRORED:
        if mcp.header_value(facts.mcp_name) != message.name:
            return Refusal(codes.CAPABILITY_ABSENT, f"the mcp-name header does not match the "
                           f"{'tool' if message.method == 'tools/call' else 'item'} in the body")
    return None
