"""The enforcement decision, pure: catalog + chain state + call facts -> an answer. No I/O, no flows, no clock.

``decide`` answers for one request as the agent sent it, in the shared vocabulary of ``capability/decision.py``
(``Allow``, ``Hold``, ``ReadBody``, or ``Refused`` with a ``Refusal`` that carries a stable code from
docs/contract.md section 5; re-exported here). ``decide_tunnel`` answers for a CONNECT, ``after_approval`` for a
held call once the person's decision (or its absence) is known.

The facts come from the edge (tether/proxy/enforce.py reads them off a mitmproxy flow); the time comes in with them.

What a request matched is each capability kind's to say: ``decide`` checks the request line (what every kind
needs: no rewrite headers, no method override, no folding characters), then asks each kind's decider in the
registry's order (``capability.kinds.DECIDERS``: a registered kind, then ``mcp``, then ``http``, each in its kind's
module under ``capability/kinds/``); the first that claims the request answers for it. A request no kind claims
is refused here (``tether.capability_absent`` on a host the catalog knows, ``tether.unknown_destination``
elsewhere). This module names no kind.
"""

from __future__ import annotations

import json
import re
import unicodedata
from urllib.parse import unquote, unquote_to_bytes

from tether.capability import errors as codes
from tether.capability.catalog import Catalog
from tether.capability.decision import (
    HTTP_STATUS,
    METHOD,
    Allow,
    Answer,
    ChainState,
    Decider,
    Decision,
    Facts,
    Hold,
    ReadBody,
    Refusal,
    Refused,
    best,
    state_and_headers,
)
from tether.capability.events import APPROVED, CANCELLED, DENIED
from tether.capability.kinds import DECIDERS

__all__ = ["DECIDERS", "HTTP_STATUS", "METHOD", "REWRITE_HEADERS", "SPELLED_HEADERS", "Allow", "Answer", "ChainState",
           "Decider", "Decision", "Facts", "Hold", "ReadBody", "Refusal", "Refused", "after_approval", "best",
           "body_override", "decide", "decide_tunnel", "state_and_headers"]

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


def decide(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision:
    """The answer for one request: see the module docstring."""
    refusal = _request_line(facts)
    if refusal is not None:
        return Refused(refusal=refusal)
    for decider in DECIDERS:
        answer = decider(catalog, chain, facts)
        if answer is not None:
            return answer
    refusal = state_and_headers(chain, facts) or (
        Refusal(codes.CAPABILITY_ABSENT, f"no capability covers {facts.method} {facts.path} on {facts.host}")
        if catalog.knows_host(facts.host, facts.port) else _unknown(facts.host, facts.port))
    return Refused(refusal=refusal)


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


def _request_line(facts: Facts) -> Refusal | None:
    """The server must read the method and path tether matched, and nothing that rewrites them."""
    if not facts.path.startswith("/"):
        return Refusal(codes.CAPABILITY_ABSENT, f"the request target {facts.path[:64]!r} is not a path (asterisk "
                       "or authority form); only requests for a path are forwarded", reason="request_target")
    if "#" in facts.path:
        return Refusal(codes.CAPABILITY_ABSENT, "a request target never carries a fragment ('#'); servers "
                       "disagree on what follows it, so it is not forwarded", reason="request_target")
    if not METHOD.fullmatch(facts.sent_method):
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
