"""Sign-in through an OpenID Connect provider: the authorization-code flow with PKCE, and the ID token read
into an operator (a name and tether roles).

The protocol is the libraries', not ours: Authlib builds the authorization request (state, nonce, the S256
code challenge) and redeems the code at the token endpoint; PyJWT checks the ID token against the provider's
published keys (signature, issuer, audience, expiry) and we compare its nonce. What is ours is the policy:
which claim names the operator and which carries the roles, and that a sign-in without a tether role is
refused rather than let in as a viewer.

A login in progress (its state, nonce and code verifier) is carried by the browser or the CLI between the two
halves (``Pending``), so the replica that finishes a login need not be the one that began it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from tether.capability.errors import BAD_REQUEST, FORBIDDEN, UNAUTHORIZED, TetherError

ROLES = ("viewer", "approver", "responder", "admin")
LOGIN_TTL_S = 600.0  # a sign-in that takes longer starts again
ALGORITHMS = ["RS256", "PS256", "ES256", "EdDSA"]  # what providers sign ID tokens with; never "none" or HMAC


@dataclass(frozen=True)
class OidcSettings:
    """What the control plane is told about its provider (``controlplane serve --oidc-*``)."""

    issuer: str
    client_id: str
    client_secret: str | None = None  # a confidential client's secret; None for a public client (PKCE alone)
    roles_claim: str = "tether_roles"
    name_claim: str = "preferred_username"
    scope: str = "openid profile"


@dataclass(frozen=True)
class Pending:
    """One sign-in between its two halves: what the callback must match."""

    state: str
    nonce: str
    code_verifier: str
    redirect_uri: str
    started_at: float

    def to_text(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> Pending:
        try:
            doc = json.loads(text)
            return cls(**{k: doc[k] for k in ("state", "nonce", "code_verifier", "redirect_uri", "started_at")})
        except (ValueError, KeyError, TypeError):
            raise TetherError("the sign-in in progress is unreadable: start again", code=BAD_REQUEST) from None


@dataclass(frozen=True)
class SignedIn:
    """Who the provider says signed in, as an operator."""

    name: str
    roles: tuple[str, ...]
    subject: str
    issuer: str
    via: str = "oidc"


# -- the policy: pure -------------------------------------------------------------------------------------------
def roles_from(claim: Any) -> tuple[str, ...]:
    """The tether roles a claim grants: a list of names or one space- or comma-separated string; others ignored."""
    if isinstance(claim, str):
        names: Iterable[Any] = claim.replace(",", " ").split()
    elif isinstance(claim, list | tuple):
        names = claim
    else:
        names = ()
    return tuple(r for r in ROLES if r in {n for n in names if isinstance(n, str)})


def operator_from(claims: dict[str, Any], settings: OidcSettings) -> SignedIn:
    """The operator an ID token's claims name; refused (``tether.forbidden``) without a tether role."""
    subject = claims.get("sub")
    name = claims.get(settings.name_claim) or subject
    if not isinstance(subject, str) or not subject or not isinstance(name, str) or not name:
        raise TetherError("the ID token names no subject", code=UNAUTHORIZED)
    roles = roles_from(claims.get(settings.roles_claim))
    if not roles:
        raise TetherError(f"{name} signed in, but the ID token's {settings.roles_claim!r} claim grants no tether "
                          f"role (one of {', '.join(ROLES)})", code=FORBIDDEN, operator=name)
    return SignedIn(name=name, roles=roles, subject=subject, issuer=str(claims.get("iss", settings.issuer)))


def check_callback(pending: Pending, state: str | None, now: float) -> None:
    if not state or state != pending.state:
        raise TetherError("the sign-in's state does not match the one this browser began: start again",
                          code=UNAUTHORIZED)
    if now - pending.started_at > LOGIN_TTL_S:
        raise TetherError(f"the sign-in took longer than {LOGIN_TTL_S:.0f} s: start again", code=UNAUTHORIZED)


# -- the edge: the provider over HTTP ----------------------------------------------------------------------------
class OidcClient:
    """The provider as the control plane (or the CLI) sees it: discovery, the two halves of a sign-in."""

    def __init__(self, settings: OidcSettings, *, timeout_s: float = 10.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._metadata: dict[str, Any] | None = None

    def _oauth(self, redirect_uri: str) -> Any:
        from authlib.integrations.httpx_client import AsyncOAuth2Client

        return AsyncOAuth2Client(
            self.settings.client_id, self.settings.client_secret, scope=self.settings.scope,
            redirect_uri=redirect_uri, code_challenge_method="S256", timeout=self.timeout_s,
            token_endpoint_auth_method="client_secret_basic" if self.settings.client_secret else "none")

    async def metadata(self) -> dict[str, Any]:
        """The provider's discovery document (fetched once); its issuer must be the one configured."""
        if self._metadata is None:
            import httpx

            url = self.settings.issuer.rstrip("/") + "/.well-known/openid-configuration"
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                    resp = await http.get(url)
                    resp.raise_for_status()
                    doc = resp.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise TetherError(f"the OpenID provider's discovery document {url} is unreachable or unreadable: "
                                  f"{exc}", code=UNAUTHORIZED) from None
            if doc.get("issuer") != self.settings.issuer:
                raise TetherError(f"the provider at {url} calls itself {doc.get('issuer')!r}, not the configured "
                                  f"issuer {self.settings.issuer!r}", code=UNAUTHORIZED)
            self._metadata = doc
        return self._metadata

    async def begin(self, redirect_uri: str, now: float | None = None) -> tuple[str, Pending]:
        """The URL to send the person to, and what the callback must match."""
        from authlib.common.security import generate_token

        meta = await self.metadata()
        verifier, nonce = generate_token(48), generate_token(24)
        url, state = self._oauth(redirect_uri).create_authorization_url(
            meta["authorization_endpoint"], code_verifier=verifier, nonce=nonce)
        return url, Pending(state=state, nonce=nonce, code_verifier=verifier, redirect_uri=redirect_uri,
                            started_at=time.time() if now is None else now)

    async def finish(self, pending: Pending, *, code: str | None, state: str | None, iss: str | None = None,
                     now: float | None = None) -> SignedIn:
        """Redeem the code (with the PKCE verifier), check the ID token, and say who signed in."""
        _, claims = await self.redeem(pending, code=code, state=state, iss=iss, now=now)
        return operator_from(claims, self.settings)

    async def redeem(self, pending: Pending, *, code: str | None, state: str | None, iss: str | None = None,
                     now: float | None = None) -> tuple[str, dict[str, Any]]:
        """The callback's half: the ID token the code is redeemed for, and its checked claims."""
        check_callback(pending, state, time.time() if now is None else now)
        if iss is not None and iss != self.settings.issuer:  # RFC 9207: a mix-up with another provider
            raise TetherError(f"the callback came from issuer {iss!r}, not {self.settings.issuer!r}",
                              code=UNAUTHORIZED)
        if not code:
            raise TetherError("the provider sent no authorization code (the sign-in was refused or cancelled)",
                              code=UNAUTHORIZED)
        meta = await self.metadata()
        try:
            async with self._oauth(pending.redirect_uri) as oauth:
                token = await oauth.fetch_token(meta["token_endpoint"], grant_type="authorization_code", code=code,
                                                code_verifier=pending.code_verifier)
        except Exception as exc:  # Authlib raises its OAuthError, httpx its HTTPError: both mean "not signed in"
            raise TetherError(f"the provider refused the authorization code: {exc}", code=UNAUTHORIZED) from None
        id_token = token.get("id_token")
        if not isinstance(id_token, str):
            raise TetherError("the provider's token answer holds no ID token (is the 'openid' scope allowed?)",
                              code=UNAUTHORIZED)
        return id_token, await self.verify_id_token(id_token, pending.nonce)

    async def verify_id_token(self, id_token: str, nonce: str | None) -> dict[str, Any]:
        """The ID token's claims, once its signature (the provider's published keys), issuer, audience, expiry
        and nonce check out."""
        import httpx
        import jwt

        meta = await self.metadata()
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                resp = await http.get(meta["jwks_uri"])
                resp.raise_for_status()
                key_set = jwt.PyJWKSet.from_dict(resp.json())
            kid = jwt.get_unverified_header(id_token).get("kid")
            key = next((k for k in key_set.keys if kid is None or k.key_id == kid), None)
            if key is None:
                raise TetherError(f"the ID token names key {kid!r}, which the provider does not publish",
                                  code=UNAUTHORIZED)
            claims = jwt.decode(id_token, key.key, algorithms=ALGORITHMS, audience=self.settings.client_id,
                                issuer=self.settings.issuer, options={"require": ["exp", "iat", "sub", "aud"]},
                                leeway=30)
        except (httpx.HTTPError, jwt.PyJWTError, ValueError) as exc:
            raise TetherError(f"the ID token does not verify: {exc}", code=UNAUTHORIZED) from None
        if nonce is not None and claims.get("nonce") != nonce:
            raise TetherError("the ID token's nonce is not this sign-in's (a replayed token?)", code=UNAUTHORIZED)
        return claims
