"""Credentials the agent never holds: the sidecar's secrets, its OAuth2 token client, and the injecting addon.

Secrets reach the sidecar only (``--secret NAME=env:VAR | NAME=file:PATH``). For a call whose capability
names a credential, the sidecar removes every credential header the agent sent (see ``AGENT_HEADERS``:
an agent that kept a copied key must not have it forwarded, nor mix its own auth with the injected one),
then injects the catalog's header with the secret, or with an OAuth2 client-credentials token it fetched
itself. Tokens are cached until shortly before they expire and fetched once per expiry, whatever the call
rate (concurrent calls share one request). Nothing leaves uncredentialed: no secret, or a token endpoint
that fails, refuses the call with ``tether.credential_unavailable``.

A credential is injected only into a request that leaves to its capability's exact host and port over TLS
verified for that host (``capability.credentials.route_refusal``); any other request under that capability is
refused with ``tether.credential_requires_tls`` before anything leaves. ``CredentialRoutes`` applies the rule
as soon as the call is decided (before an approval is asked for, a budget unit spent or a start spooled), and
the ``Injector`` applies it again at the moment it injects.

Every value injected (secrets, tokens, the rendered header values) is handed to the capture writer, which
redacts it wherever it appears in a captured flow (tether/proxy/capture.py); none is ever logged.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, quote_plus, urlencode

from mitmproxy import ctx, http

from tether.capability import errors as codes
from tether.capability.catalog import Catalog, host_key, url_route
from tether.capability.credentials import Credential, Leaving, Route, route_refusal

from . import http1
from .decision import ChainState, Refusal
from .flowstate import refuse, state_of
from .secrets import SecretSpec, load_secrets

__all__ = ["SecretSpec", "load_secrets"]  # their home before tether/proxy/secrets.py: callers still import them here

log = logging.getLogger("tether.sidecar.credentials")

# Removed from a request to a destination whose capability injects a credential, besides the injected header
# itself: the standard and the most common API-key carriers. Cookie too: a session cookie is a credential the
# agent could have obtained with a key it no longer holds. (Query-string keys are not touched: docs/threat-model.md.)
AGENT_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "x-auth-token", "cookie")
DEFAULT_LIFETIME_S = 300.0  # a token answer without expires_in is trusted this long
FAILURE_HOLD_S = 1.0  # after a failed token request, calls are refused this long before the next attempt
MIN_SCRUB = 6  # shorter values are not scrubbed from captures by value (they would redact ordinary text)


class CredentialUnavailable(Refusal):
    def __init__(self, message: str, *, credential: str) -> None:
        super().__init__(codes.CREDENTIAL_UNAVAILABLE, message, credential=credential)


class CredentialRequiresTls(Refusal):
    def __init__(self, message: str, *, credential: str, route: Route) -> None:
        super().__init__(codes.CREDENTIAL_REQUIRES_TLS, message + "; the call was not sent", credential=credential,
                         destination=str(route))


def upstream_verified() -> bool:
    """mitmproxy verifies upstream certificates unless ``ssl_insecure`` is on (tether never turns it on; a
    sidecar that cannot tell counts as not verifying)."""
    try:
        return ctx.options.ssl_insecure is False
    except AttributeError:
        return False


def leaving(flow: http.HTTPFlow) -> Leaving:
    """Where and how this request's upstream connection goes.

    mitmproxy connects to the request's host and port, with TLS when its scheme is https, reusing the flow's
    connection when that one has this address (then its server name, which the tunnel fixed to the CONNECT host,
    is what the certificate is verified for) and otherwise opening one named for the request's host."""
    req, conn = flow.request, flow.server_conn
    reused = conn.address is not None and (conn.address[0], conn.address[1]) == (req.host, req.port)
    sni = (conn.sni or flow.client_conn.sni or req.host) if reused else req.host  # as mitmproxy chooses it
    return Leaving(scheme=req.scheme, host=host_key(req.host), port=req.port, sni=host_key(sni),
                   verified=upstream_verified())


def _credential_of(catalog: Catalog, flow: http.HTTPFlow) -> tuple[Credential, Route | None] | None:
    """The credential this flow's call injects and the route it may go to (None: the catalog names none)."""
    state = state_of(flow)
    if state.mcp_server is not None:
        credential = catalog.mcp_credential(state.mcp_server)
        return (credential, url_route(state.mcp_server)) if credential is not None else None
    call = state.call
    if call is None or not call.capability:
        return None
    credential = catalog.credential_of(call.capability)
    return (credential, catalog.route_of(call.capability)) if credential is not None else None


def check_route(catalog: Catalog, flow: http.HTTPFlow) -> Credential | None:
    """The credential to inject into this flow, or None; raises CredentialRequiresTls when the request would
    not leave to its capability's exact host and port over verified TLS."""
    found = _credential_of(catalog, flow)
    if found is None:
        return None
    credential, route = found
    if route is None:  # the catalog refuses such a capability; a sidecar never sends one a credential
        raise CredentialRequiresTls(f"the capability of credential {credential.name} names no scheme and port",
                                    credential=credential.name, route=Route("https", "?", 0))
    why = route_refusal(route, credential, leaving(flow))
    if why is not None:
        raise CredentialRequiresTls(why, credential=credential.name, route=route)
    return credential


def check_scheme(catalog: Catalog, flow: http.HTTPFlow) -> None:
    """A capability that names its ``scheme`` is reached over that scheme only: another request to its host and
    port does not fall under it (``tether.capability_absent``, reason ``scheme``). (Matching itself compares host,
    port, method and path; the scheme is read here, once the capability is known.)"""
    call = state_of(flow).call
    cap = catalog.capabilities.get(call.capability or "") if call is not None else None
    if cap is not None and cap.http is not None and cap.http.scheme not in (None, flow.request.scheme):
        raise Refusal(codes.CAPABILITY_ABSENT, f"capability {cap.name} is reached over {cap.http.scheme} only; this "
                      f"request is {flow.request.scheme}", reason="scheme")


class CredentialRoutes:
    """Refuses a credentialed call that would not leave over verified TLS to its capability's exact host and
    port, as soon as it is decided: before an approval is asked for, a budget unit taken or a start spooled.
    Also refuses a call over another scheme than its capability names (``check_scheme``).

    Runs right after the Enforcer (which names the call's capability or MCP server)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._check(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        self._check(flow)

    def _check(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        try:
            check_route(self.catalog, flow)
            check_scheme(self.catalog, flow)
        except Refusal as refusal:
            log.warning("refused %s %s: %s", flow.request.method, flow.request.pretty_url, refusal.message)
            refuse(flow, refusal)


# -- secrets: parsed and read in tether/proxy/secrets.py (light: tether run reads them without the proxy's imports) ----


# -- OAuth2 client credentials ------------------------------------------------------------------------------
@dataclass
class Token:
    value: str
    expires_at: float  # monotonic
    refresh_at: float  # monotonic: a new token is fetched from here on


def token_times(now: float, expires_in: float) -> tuple[float, float]:
    """(expires_at, refresh_at): refreshed before it expires, by a tenth of its life (at most 30 s), so a call
    never leaves with a token that dies on the way."""
    return now + expires_in, now + expires_in - min(30.0, expires_in / 10)


class TokenClient:
    """One credential's token: cached, refreshed once per expiry, one request in flight at a time."""

    def __init__(self, credential: Credential, client_secret: str, session: http1.Client) -> None:
        assert credential.oauth2 is not None
        self.credential = credential
        self.secret = client_secret
        self.session = session  # carries the TLS context the token endpoint is verified with
        self.token: Token | None = None
        self.issued: list[str] = []  # every token fetched (bounded): redacted from captures by value
        self.fetched = 0  # tokens fetched: what is redacted changes only then
        self.requests = 0
        self._pending: asyncio.Future[str] | None = None
        self._failed: tuple[float, str] | None = None

    def cached(self, now: float) -> str | None:
        if self.token is not None and now < self.token.refresh_at:
            return self.token.value
        return None

    async def get(self) -> str:
        now = time.monotonic()
        value = self.cached(now)
        if value is not None:
            return value
        if self._failed is not None and now < self._failed[0]:
            raise CredentialUnavailable(self._failed[1], credential=self.credential.name)
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._fetch())
            self._pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved"
        pending = self._pending
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done() and self._pending is pending:
                self._pending = None

    async def _fetch(self) -> str:
        oauth = self.credential.oauth2
        assert oauth is not None
        form = {"grant_type": "client_credentials"}
        if oauth.scope:
            form["scope"] = oauth.scope
        if oauth.audience:
            form["audience"] = oauth.audience
        headers = {"Accept": "application/json", "Content-Type": "application/x-www-form-urlencoded"}
        if oauth.client_auth == "basic":  # RFC 6749 2.3.1: id and secret form-encoded, then Basic
            pair = f"{quote(oauth.client_id, safe='')}:{quote(self.secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            form.update(client_id=oauth.client_id, client_secret=self.secret)
        self.requests += 1
        sent = time.monotonic()
        why: str
        try:
            resp = await self.session.request("POST", oauth.token_url, body=urlencode(form).encode(),
                                              headers=headers, timeout=10.0)
            if resp.status != 200:
                why = f"the token endpoint {oauth.token_url} answered HTTP {resp.status}"
            else:
                value, expires_in = _token_from(json.loads(resp.body))
                expires_at, refresh_at = token_times(sent, expires_in)
                self.token = Token(value, expires_at, refresh_at)
                self.issued = [*self.issued[-7:], value]
                self.fetched += 1
                self._failed = None
                log.info("credential %s: token fetched from %s (valid %.0fs)", self.credential.name,
                         oauth.token_url, expires_in)
                return value
        except (TimeoutError, OSError) as exc:  # http1.ClientError is an OSError
            why = f"the token endpoint {oauth.token_url} could not be reached ({type(exc).__name__})"
        except ValueError as exc:
            why = f"the token endpoint {oauth.token_url} gave no usable token ({exc})"
        message = f"no token for credential {self.credential.name}: {why}; the call was not sent"
        log.warning("%s", message)
        self._failed = (time.monotonic() + FAILURE_HOLD_S, message)
        raise CredentialUnavailable(message, credential=self.credential.name)


def _token_from(doc: object) -> tuple[str, float]:
    """The token and its lifetime from a token response (RFC 6749 5.1); ValueError when unusable."""
    if not isinstance(doc, dict):
        raise ValueError("the answer is not a JSON object")
    value = doc.get("access_token")
    if not isinstance(value, str) or not value or any(ord(c) < 0x21 or ord(c) == 0x7F for c in value):
        raise ValueError("access_token is missing or not a header-safe string")
    expires_in = doc.get("expires_in", DEFAULT_LIFETIME_S)
    if isinstance(expires_in, str) and expires_in.isdigit():
        expires_in = int(expires_in)
    if not isinstance(expires_in, int | float) or isinstance(expires_in, bool) or expires_in <= 0:
        raise ValueError(f"expires_in {expires_in!r} is not a positive number")
    return value, float(expires_in)


def spelled(value: bytes) -> set[bytes]:
    """The ways an injected value can appear in a message a tool sends back: as it is, percent-encoded (a URL, a
    form), JSON-escaped, and base64 (standard and URL-safe) at each of the three alignments it can start at inside
    a longer base64 text (a ``Basic`` header, an echoed body): only the characters that depend on the value alone,
    so the value is found whatever surrounds it. Bodies are searched decoded (tether/proxy/capture.py)."""
    forms = {value, quote(value, safe="").encode(), quote_plus(value, safe="").encode()}
    text = value.decode("utf-8", "replace")
    forms.add(json.dumps(text)[1:-1].encode())
    forms.add(json.dumps(text, ensure_ascii=False)[1:-1].encode())
    for offset in range(3):
        total = offset + len(value)
        inner = base64.b64encode(b"\0" * offset + value)[(4 if offset else 0):(total // 3) * 4]
        forms.update((inner, inner.translate(_URLSAFE)))
    return forms


_URLSAFE = bytes.maketrans(b"+/", b"-_")


# -- the sidecar's credentials ---------------------------------------------------------------------------------
class Credentials:
    """The secrets this sidecar holds and the tokens it has fetched, for one catalog."""

    def __init__(self, secrets: Mapping[str, str], upstream_ca: str | None = None) -> None:
        self.secrets = dict(secrets)
        self.upstream_ca = upstream_ca
        self.catalog: Catalog | None = None
        self.clients: dict[str, TokenClient] = {}
        self._session: http1.Client | None = None
        # Per process, not per call: what to strip for each credential, and the values to redact (made again
        # only when a token was fetched).
        self._strip: dict[str, frozenset[bytes]] = {}
        self._values: tuple[tuple, list[bytes]] = ((None,), [])  # (the tokens it was made from, the values)

    def bind(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._strip = {name: frozenset(h.encode() for h in (*AGENT_HEADERS, cred.header.lower()))
                       for name, cred in catalog.credentials.items()}
        self._values = ((None,), [])
        unknown = sorted(set(self.secrets) - set(catalog.credentials))
        if unknown:
            log.warning("--secret %s names no credential in the catalog; it is not used", ", ".join(unknown))
        lacking = sorted(set(catalog.credentials) - set(self.secrets))
        if lacking:
            log.warning("no secret for credential(s) %s: calls that need them are refused "
                        "(tether.credential_unavailable)", ", ".join(lacking))

    def header_names(self) -> frozenset[bytes]:
        names = {c.header.lower() for c in (self.catalog.credentials.values() if self.catalog else ())}
        return frozenset(n.encode() for n in names)

    def strip(self, credential: Credential) -> frozenset[bytes]:
        """The request headers (lower case) removed before ``credential`` is injected."""
        names = self._strip.get(credential.name)
        if names is None:
            names = frozenset(h.encode() for h in (*AGENT_HEADERS, credential.header.lower()))
        return names

    def values(self) -> list[bytes]:
        """Every value this sidecar may have injected, for redaction by value (longest first)."""
        key = tuple((name, client.fetched) for name, client in self.clients.items())
        if key != self._values[0]:
            self._values = (key, self._collect())
        return self._values[1]

    def _collect(self) -> list[bytes]:
        out: set[str] = set()
        creds = self.catalog.credentials if self.catalog else {}
        for name, secret in self.secrets.items():
            out.add(secret)
            if name in creds and creds[name].oauth2 is None:
                out.add(creds[name].render(secret))
        for client in self.clients.values():
            for token in client.issued:
                out.add(token)
                out.add(client.credential.render(token))
        spellings = {form for v in out if len(v) >= MIN_SCRUB for form in spelled(v.encode())}
        return sorted((v for v in spellings if len(v) >= MIN_SCRUB), key=len, reverse=True)

    def _client(self, credential: Credential) -> TokenClient:
        client = self.clients.get(credential.name)
        if client is None:
            if self._session is None:
                context: ssl.SSLContext | None = None  # http1's default: the system's trust store
                if self.upstream_ca:
                    context = ssl.create_default_context()
                    context.load_verify_locations(self.upstream_ca)
                self._session = http1.Client(ssl_context=context, max_body=1024 * 1024)
            client = self.clients[credential.name] = TokenClient(credential, self.secrets[credential.name],
                                                                 self._session)
        return client

    def value(self, credential: Credential) -> str | Awaitable[str]:
        """The header value now (a static secret, a cached token), or an awaitable when a token must be fetched.
        Raises CredentialUnavailable when this sidecar holds no secret for it."""
        secret = self.secrets.get(credential.name)
        if secret is None:
            raise CredentialUnavailable(f"this sidecar holds no secret for credential {credential.name} (start it "
                                        f"with --secret {credential.name}=env:VAR or =file:PATH); the call was "
                                        "not sent", credential=credential.name)
        if credential.oauth2 is None:
            return credential.render(secret)
        client = self._client(credential)
        token = client.cached(time.monotonic())
        if token is not None:
            return credential.render(token)

        async def fetched() -> str:
            return credential.render(await client.get())

        return fetched()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class Injector:
    """Strips the agent's credential headers and injects the sidecar's, for calls whose capability names one.

    Runs after the enforcement addons (tether/proxy/enforce.py: the call is decided, held calls approved) and before
    Capture (which redacts what it injected). A streamed upload's headers leave at ``requestheaders``; every
    other request's at ``request``."""

    def __init__(self, catalog: Catalog, credentials: Credentials, chain: ChainState) -> None:
        self.catalog, self.credentials, self.chain = catalog, credentials, chain

    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        if flow.response is None and flow.request.stream:
            return self._inject(flow)
        return None

    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        if flow.response is None and not flow.request.stream:
            return self._inject(flow)
        return None

    def _inject(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        try:
            credential = check_route(self.catalog, flow)  # again, at the moment it would be injected
            if credential is None:
                return None
            headers = flow.request.headers
            strip = self.credentials.strip(credential)
            if any(k.lower() in strip for k, _ in headers.fields):  # one pass, not a lookup per name
                headers.fields = tuple(f for f in headers.fields if f[0].lower() not in strip)
            value = self.credentials.value(credential)
        except Refusal as refusal:
            refuse(flow, refusal)
            return None
        if isinstance(value, str):
            headers[credential.header] = value
            return None
        return self._later(flow, credential, value)

    async def _later(self, flow: http.HTTPFlow, credential: Credential, value: Awaitable[str]) -> None:
        try:
            header = await value
            # The token request took time: a revocation or a drain may have arrived meanwhile.
            refusal = self.chain.refusal(time.time(), time.monotonic())
            if refusal is not None:
                raise refusal
        except Refusal as refusal:
            refuse(flow, refusal)
            return
        flow.request.headers[credential.header] = header
