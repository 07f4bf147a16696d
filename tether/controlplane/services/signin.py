"""Single sign-on: operators who sign in through the configured OpenID Connect provider.

Two doors, one rule. The console's (a web client): ``begin`` sends the browser to the provider with a signed
cookie carrying what the callback must match, and ``finish`` turns the callback into an operator for a console
session. The CLI's (a native client, ``tether login``): it runs the flow itself on a loopback port and hands
the ID token over, which ``exchange`` checks again (issuer, audience = the CLI's client, freshness, used once)
before it answers with a short-lived operator token. Either way the person becomes ``NAME`` with the roles the
provider's claim names, ``via: oidc``, and a sign-in without a tether role is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability import keys
from tether.capability.errors import FORBIDDEN, UNAUTHORIZED, ApiError, TetherError

from ..auth import BOOTSTRAP, Operator
from ..oidc import OidcClient, OidcSettings, Pending, SignedIn, operator_from
from ..store import Store
from . import kinds
from .operators import OperatorService

ID_TOKEN_MAX_AGE_S = 600.0  # an ID token older than this is not exchanged (it was issued for another sign-in)
MAX_NAME = 128


@dataclass(frozen=True)
class SsoConfig:
    settings: OidcSettings  # the console's client
    cli_client_id: str | None = None  # the CLI's (native, public) client; None: tether login is not offered
    console_ttl_s: float = 8 * 3600.0
    cli_ttl_s: float = 3600.0


def check_operator_name(name: str) -> str:
    if name == BOOTSTRAP:
        raise TetherError(f"the provider names this person {BOOTSTRAP!r}, the bootstrap admin's name: refused",
                          code=FORBIDDEN)
    if len(name) > MAX_NAME or not name.isprintable() or any(c.isspace() for c in name):
        raise TetherError(f"the provider's name claim {name[:40]!r} is not a usable operator name (printable, no "
                          f"spaces, at most {MAX_NAME} characters)", code=FORBIDDEN)
    return name


def seal_pending(pending: Pending, key: Ed25519PrivateKey) -> str:
    """The sign-in in progress as a cookie value any replica can check (signed with the control plane's key)."""
    text = pending.to_text().encode()
    return f"{keys.b64url(text)}.{keys.b64url(key.sign(text))}"


def open_pending(value: str, key: Ed25519PrivateKey) -> Pending:
    try:
        text, signature = (keys.b64url_decode(part) for part in value.split(".", 1))
        key.public_key().verify(signature, text)
    except (ValueError, InvalidSignature):
        raise TetherError("this browser holds no sign-in in progress (or it was altered): start again",
                          code=UNAUTHORIZED) from None
    return Pending.from_text(text.decode())


class SingleSignOn:
    def __init__(self, config: SsoConfig, operators: OperatorService, store: Store, signing_key: Ed25519PrivateKey,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.operators = operators
        self.store = store
        self.signing_key = signing_key
        self.clock = clock
        self.console = OidcClient(config.settings)
        self.cli = OidcClient(replace(config.settings, client_id=config.cli_client_id, client_secret=None)) \
            if config.cli_client_id else None

    def describe(self) -> dict[str, Any]:
        s = self.config.settings
        return {"issuer": s.issuer, "client_id": s.client_id, "cli_client_id": self.config.cli_client_id,
                "scope": s.scope, "roles_claim": s.roles_claim, "name_claim": s.name_claim}

    # -- the console's door -----------------------------------------------------------------------------------
    async def begin(self, redirect_uri: str) -> tuple[str, str]:
        """Where to send the browser, and the cookie value the callback must bring back."""
        try:
            url, pending = await self.console.begin(redirect_uri, self.clock())
        except TetherError as exc:  # the provider is unreachable or not the one configured
            raise ApiError(503, exc.code, exc.message) from None
        return url, seal_pending(pending, self.signing_key)

    async def finish(self, cookie: str, query: dict[str, str]) -> Operator:
        if "error" in query:
            raise TetherError(f"the provider refused the sign-in: {query['error']} "
                              f"{query.get('error_description', '')}".strip(), code=UNAUTHORIZED)
        try:
            pending = open_pending(cookie, self.signing_key)
            who = await self.console.finish(pending, code=query.get("code"), state=query.get("state"),
                                            iss=query.get("iss"), now=self.clock())
        except TetherError as exc:
            raise ApiError(403 if exc.code == FORBIDDEN else 401, exc.code, exc.message) from None
        _, operator = await self._sign_in(who, self.config.console_ttl_s)
        return operator

    # -- the CLI's door ---------------------------------------------------------------------------------------
    async def exchange(self, id_token: str) -> dict[str, Any]:
        """An ID token the CLI got for its own client, for an operator token of ``cli_ttl_s``."""
        if self.cli is None:
            raise ApiError(404, "tether.not_found", "this control plane offers no CLI sign-in (--oidc-cli-client-id)")
        try:
            claims = await self.cli.verify_id_token(id_token, None)  # the CLI checked the nonce it chose
        except TetherError as exc:
            raise ApiError(401, UNAUTHORIZED, exc.message) from None
        if not isinstance(claims.get("iat"), int | float) or self.clock() - claims["iat"] > ID_TOKEN_MAX_AGE_S:
            raise ApiError(401, UNAUTHORIZED, f"the ID token was issued more than {ID_TOKEN_MAX_AGE_S:.0f} s ago: "
                           "sign in again")
        used = keys.b64url(_digest(id_token))
        if not await self.store.cas_doc(kinds.OIDC_ID_TOKEN_USED, used, 0, {"version": 1, "at": self.clock(),
                                                          "expires_at": claims.get("exp")}):
            raise ApiError(401, UNAUTHORIZED, "this ID token was exchanged already: sign in again")
        try:
            who = operator_from(claims, self.cli.settings)
        except TetherError as exc:
            raise ApiError(403 if exc.code == FORBIDDEN else 401, exc.code, exc.message) from None
        token, operator = await self._sign_in(who, self.config.cli_ttl_s)
        return {"token": token, "operator": operator.name, "via": operator.via, "roles": sorted(operator.roles),
                "expires_in_s": self.config.cli_ttl_s}

    async def _sign_in(self, who: SignedIn, ttl_s: float) -> tuple[str, Operator]:
        try:
            name = check_operator_name(who.name)
        except TetherError as exc:
            raise ApiError(403, exc.code, exc.message) from None
        return await self.operators.sign_in(name, who.roles, ttl_s, who.subject, who.issuer)


def _digest(text: str) -> bytes:
    import hashlib

    return hashlib.sha256(text.encode()).digest()
