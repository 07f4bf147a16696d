"""The ``mcp`` kind's decider: every request to one of the catalog's MCP endpoints (``capability/kinds/mcp.py``'s
index). A JSON-RPC POST is decided once its body is here, every message granted or none leaves; a GET (the
server's stream) or DELETE (the session's end) needs something on that server granted."""

from __future__ import annotations

from dataclasses import dataclass

from tether.capability import errors as codes
from tether.capability.catalog import Catalog
from tether.capability.kinds import mcp as kind

from .. import mcp
from ..decision import Allow, ChainState, Decision, Facts, Hold, ReadBody, Refusal, Refused, best, state_and_headers
from . import http

NAME = kind.NAME


def decide(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision | None:
    """The answer for a request to an MCP endpoint of the catalog; None (not claimed) for any other URL."""
    server = catalog.indexes[NAME].server(facts.url)
    if server is None:
        return None
    if facts.method == "POST":
        if facts.body is None:
            return ReadBody(server=server)
        return _decide_rpc(catalog, chain, facts, server)
    capability, tier = http.matched(catalog, chain, facts)  # what the report names, as for any request line
    refusal = state_and_headers(chain, facts)
    if refusal is not None:
        return Refused(refusal=refusal, capability=capability, tier=tier, server=server)
    return _decide_stream(catalog, chain, facts, server, capability, tier)


def _plumbing(catalog: Catalog, chain: ChainState, server: str) -> Refusal | None:
    """Session plumbing needs some item (a tool, resource, prompt or piece of plumbing) granted on that server."""
    if any(chain.tier(c) != "absent" for c in catalog.indexes[NAME].capabilities(server)):
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
    index = catalog.indexes[NAME]
    if method == "tools/call":
        return [_Need(index.item(server, "tool", message.tool or ""), f"tool {message.tool!r}",
                      fallback=f"mcp:{message.tool}")]
    if method == "prompts/get":
        return [_Need(index.item(server, "prompt", message.prompt or ""), f"prompt {message.prompt!r}")]
    if method == "resources/read":
        return [_Need(index.resource(server, message.uri or ""), f"resource {message.uri!r}")]
    if method in ("resources/subscribe", "resources/unsubscribe"):
        ending = method == "resources/unsubscribe"  # ending a subscription is never held, never counted
        return [_Need(index.resource(server, message.uri or ""), f"resource {message.uri!r}", uses=False),
                _Need(index.item(server, "subscriptions"), f"subscriptions on {server}", uses=not ending)]
    if method == mcp.LISTEN:
        if not message.uris:
            return None  # list-changed notifications only: plumbing, as the GET listen stream is
        return [*(_Need(index.resource(server, uri), f"resource {uri!r}", uses=False) for uri in message.uris),
                _Need(index.item(server, "subscriptions"), f"subscriptions on {server}")]
    if method == "logging/setLevel":
        return [_Need(index.item(server, "logging"), f"logging on {server}")]
    if method == "completion/complete":
        if message.prompt is not None:
            about = _Need(index.item(server, "prompt", message.prompt), f"prompt {message.prompt!r}",
                          uses=False)
        else:
            about = _Need(index.resource_template(server, message.uri or ""), f"resource {message.uri!r}",
                          uses=False)
        return [_Need(index.item(server, "completion"), f"completion on {server}"), about]
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
                name, tier = best(chain, need.names) if need.names else (None, "absent")
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
    refusal = refusal or _rpc_headers(facts, parsed) or state_and_headers(chain, facts)
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
