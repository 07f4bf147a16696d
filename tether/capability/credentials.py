"""The catalog's ``credentials:`` section: what a sidecar injects for a capability, never the secret itself.

A credential names a header and a format. A static one formats ``{secret}`` (a value the sidecar is given
with ``--secret NAME=...``); an OAuth2 client-credentials one formats ``{token}``, a token the sidecar
fetches from ``token_url`` with its client id and the client secret it was given. The catalog holds no
secret value: it is served to sidecars and hashed into every grant, so it says only *how* to inject.

A credential goes to one place only: its capability's ``Route`` (scheme, host and port). ``route_refusal`` is
the rule the sidecar applies to every request before it injects: the request must leave to exactly that host
and port, over TLS whose certificate is verified for that host. Plain HTTP is possible only for a credential
that says ``insecure_plain_http: loopback``, and then only to a loopback address (the catalog checks both).

Pure parsing and validation; the sidecar's injection and token client live in ``tether/proxy/credentials.py``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .errors import CatalogError

_CRED_KEYS = {"header", "format", "oauth2_client_credentials", "description", "insecure_plain_http"}
_OAUTH_KEYS = {"token_url", "client_id", "scope", "audience", "client_auth"}
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")  # an HTTP header name (RFC 9110 token)
# Headers whose meaning is the message's framing or routing: injecting one would change what tether matched.
_FORBIDDEN_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
                      "tether-chain", "keep-alive", "proxy-connection", ":authority"}
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
# The one value of ``insecure_plain_http``: a credential that may travel in clear text, to this machine only.
PLAIN_HTTP_LOOPBACK = "loopback"


def is_loopback(host: str) -> bool:
    """``localhost``, or an address of the loopback network (127.0.0.0/8, ::1), in any spelling the catalog
    compares (an IPv6 literal bracketed or not)."""
    host = host.lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class OAuth2ClientCredentials:
    token_url: str
    client_id: str
    scope: str = ""
    audience: str = ""
    client_auth: str = "basic"  # RFC 6749 2.3.1: every server must accept HTTP Basic; "post" sends it in the form

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token_url": self.token_url, "client_id": self.client_id}
        for key in ("scope", "audience"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.client_auth != "basic":
            out["client_auth"] = self.client_auth
        return out


@dataclass(frozen=True)
class Credential:
    name: str
    header: str = "Authorization"
    format: str = "Bearer {secret}"
    oauth2: OAuth2ClientCredentials | None = None
    description: str = ""
    insecure_plain_http: str | None = None  # PLAIN_HTTP_LOOPBACK: may be sent in clear to a loopback upstream

    @property
    def placeholder(self) -> str:
        return "{token}" if self.oauth2 is not None else "{secret}"

    def render(self, value: str) -> str:
        """The header value: the format with its one placeholder replaced (never ``str.format``: a secret
        holding braces is data, not a template)."""
        return self.format.replace(self.placeholder, value)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"header": self.header, "format": self.format}
        if self.oauth2 is not None:
            out["oauth2_client_credentials"] = self.oauth2.to_dict()
        if self.description:
            out["description"] = self.description
        if self.insecure_plain_http:  # only when set: other catalogs keep their hash
            out["insecure_plain_http"] = self.insecure_plain_http
        return out


@dataclass(frozen=True)
class Route:
    """Where a credentialed capability's requests go: the only scheme, host and port its credential is sent to.
    ``host`` is spelled as the catalog compares hosts (lower case, an IPv6 literal bracketed)."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Leaving:
    """How one request would leave the sidecar, as far as a credential cares.

    ``host`` and ``port`` are where the upstream connection goes (the request's destination, spelled as the
    catalog compares hosts); ``sni`` the TLS server name the upstream certificate is verified for; ``verified``
    whether upstream certificates are verified at all."""

    scheme: str
    host: str
    port: int
    sni: str | None
    verified: bool


def route_refusal(route: Route, credential: Credential, leaving: Leaving) -> str | None:
    """Why ``credential`` must not be injected into a request leaving as ``leaving`` (a sentence for the agent),
    or None when it may: to the route's exact host and port, over TLS verified for the route's host; over
    plain HTTP only to a loopback route whose credential opted in (``insecure_plain_http: loopback``)."""
    if (leaving.host, leaving.port) != (route.host, route.port):
        return (f"the credential {credential.name} is sent only to {route.host}:{route.port}; this request goes to "
                f"{leaving.host}:{leaving.port}")
    if leaving.scheme != route.scheme:
        if route.scheme == "https":
            return (f"the credential {credential.name} is sent only over TLS ({route}); this request would leave "
                    f"as plain {leaving.scheme}")
        return f"the credential {credential.name} is sent only to {route}; this request is {leaving.scheme}"
    if route.scheme == "https":
        if not leaving.verified:
            return (f"upstream certificates are not verified by this sidecar: the credential {credential.name} is "
                    "never sent over unverified TLS")
        if leaving.sni is None or leaving.sni != route.host:
            return (f"the upstream certificate would be verified for {leaving.sni!r}, not {route.host}: the "
                    f"credential {credential.name} is not sent")
        return None
    if route.scheme == "http" and credential.insecure_plain_http == PLAIN_HTTP_LOOPBACK and is_loopback(route.host):
        return None
    return f"the credential {credential.name} is never sent over plain http to {route.host}"


def _fail(source: str, where: str, message: str) -> CatalogError:
    return CatalogError(f"{source}: {where}: {message}", source=source, where=where)


def _string(source: str, where: str, value: Any, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise _fail(source, where, f"expected a non-empty string, got {value!r}")
    return value


def _parse_oauth2(source: str, where: str, raw: Any) -> OAuth2ClientCredentials:
    if not isinstance(raw, dict):
        raise _fail(source, where, f"expected a mapping, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in _OAUTH_KEYS)
    if unknown:
        raise _fail(source, where, f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(_OAUTH_KEYS))})")
    url = _string(source, f"{where}.token_url", raw.get("token_url"))
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as exc:
        raise _fail(source, f"{where}.token_url", f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(source, f"{where}.token_url", f"expected an https URL, got {url!r}")
    if parts.scheme == "http" and parts.hostname not in _LOOPBACK:
        # The client secret travels in this request: in clear text only to the machine itself.
        raise _fail(source, f"{where}.token_url", "the client secret is sent to the token endpoint: it must be "
                    "https (plain http is allowed only to localhost)")
    client_auth = raw.get("client_auth", "basic")
    if client_auth not in ("basic", "post"):
        raise _fail(source, f"{where}.client_auth", f"expected basic or post, got {client_auth!r}")
    return OAuth2ClientCredentials(
        token_url=url, client_id=_string(source, f"{where}.client_id", raw.get("client_id")),
        scope=_string(source, f"{where}.scope", raw.get("scope"), required=False),
        audience=_string(source, f"{where}.audience", raw.get("audience"), required=False),
        client_auth=client_auth)


def parse_credentials(source: str, raw: Any) -> dict[str, Credential]:
    """The ``credentials:`` mapping, validated. Raises CatalogError naming the credential and the field."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(source, "credentials", "expected a mapping of credential name -> {header, format, ...}")
    out: dict[str, Credential] = {}
    for name, spec in raw.items():
        where = f"credential {name!r}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            raise _fail(source, where, "credential names are 1-64 letters, digits and . _ -")
        if not isinstance(spec, dict):
            raise _fail(source, where, f"expected a mapping, got {type(spec).__name__}")
        unknown = sorted(str(k) for k in spec if k not in _CRED_KEYS)
        if unknown:
            raise _fail(source, where, f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(_CRED_KEYS))})")
        oauth2 = (_parse_oauth2(source, f"{where}.oauth2_client_credentials", spec["oauth2_client_credentials"])
                  if "oauth2_client_credentials" in spec else None)
        header = _string(source, f"{where}.header", spec.get("header", "Authorization"))
        if not _TOKEN.fullmatch(header) or header.lower() in _FORBIDDEN_HEADERS:
            raise _fail(source, f"{where}.header", f"{header!r} is not a header a credential may be injected in")
        placeholder = "{token}" if oauth2 is not None else "{secret}"
        fmt = _string(source, f"{where}.format", spec.get("format", f"Bearer {placeholder}"))
        if fmt.count(placeholder) != 1:
            raise _fail(source, f"{where}.format", f"must contain {placeholder} exactly once, got {fmt!r}")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in fmt):
            raise _fail(source, f"{where}.format", "control characters cannot be sent in a header")
        description = spec.get("description", "")
        if not isinstance(description, str):
            raise _fail(source, f"{where}.description", "expected a string")
        plain = spec.get("insecure_plain_http")
        if plain is not None and plain != PLAIN_HTTP_LOOPBACK:
            raise _fail(source, f"{where}.insecure_plain_http", f"the only value is {PLAIN_HTTP_LOOPBACK!r} (the "
                        f"credential may be sent in clear text to a loopback upstream), got {plain!r}")
        out[name] = Credential(name=name, header=header, format=fmt, oauth2=oauth2, description=description,
                               insecure_plain_http=plain)
    return out
