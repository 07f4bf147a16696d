"""Operators: the named people who decide, with their roles and tokens.

An operator is a document (kind ``operator``, by name) holding its roles, the SHA-256 hash of its current
token, its expiry and its history (who added, rotated or revoked it, how they signed in, when). A second
document (kind ``operator_token``, by token hash) names the operator a token belongs to; it is only a
pointer: a token proves an operator only while the operator's own document still holds its hash, so a
rotated or revoked token stops working at once, on every replica, with nothing to delete. The token itself
is returned once, by ``add`` and ``rotate``, and never stored.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from tether.capability.errors import BAD_REQUEST, CONFLICT, FORBIDDEN, NOT_FOUND, ApiError

from ..auth import BOOTSTRAP, ROLES, Operator, token_hash
from ..metrics import Metrics
from ..store import Doc, Store
from . import kinds

VIA_OIDC = "oidc"
NAME = re.compile(r"[a-z][a-z0-9._-]{0,63}")
MAX_EXPIRY_S = 10 * 365 * 86400
ADDED, ROTATED, REVOKED = "added", "rotated", "revoked"


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ApiError(400, BAD_REQUEST, f"operator name {name!r}: use 1-64 of a-z, 0-9, '.', '_', '-', starting with "
                       "a letter", field="name")
    if name == BOOTSTRAP:
        raise ApiError(400, BAD_REQUEST, f"{BOOTSTRAP!r} is the bootstrap admin (TETHER_ADMIN_TOKEN); name the "
                       "person instead", field="name")
    return name


def check_roles(roles: list[Any]) -> list[str]:
    if not roles or not all(isinstance(r, str) for r in roles):
        raise ApiError(400, BAD_REQUEST, f"'roles' must list at least one of {', '.join(ROLES)}", field="roles")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ApiError(400, BAD_REQUEST, f"unknown role(s) {', '.join(unknown)}: the roles are {', '.join(ROLES)}",
                       field="roles")
    return [r for r in ROLES if r in roles]


def view(doc: Doc, now: float) -> Doc:
    """An operator as listed: never its token's hash."""
    expired = doc.get("expires_at") is not None and doc["expires_at"] <= now
    status = "revoked" if doc.get("revoked_at") else ("expired" if expired else "active")
    return {"name": doc["name"], "roles": doc["roles"], "status": status, "created_at": doc["created_at"],
            "expires_at": doc.get("expires_at"), "rotated_at": doc.get("rotated_at"),
            "revoked_at": doc.get("revoked_at"), "history": doc["history"]}


class OperatorService:
    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock

    # -- who a token or a session is (tether/controlplane/auth.py asks) --------------------------------------------
    async def by_token(self, token: str, now: float) -> Operator | None:
        digest = token_hash(token)
        pointer = await self.store.get_doc(kinds.OPERATOR_TOKEN, digest)
        if pointer is not None:
            return await self.current(pointer["name"], digest, now)
        return await self._signed_in(digest, None, now)

    async def current(self, name: str, digest: str, now: float) -> Operator | None:
        """The operator ``name`` while ``digest`` is the hash of its current, unexpired, unrevoked token (or of
        a single sign-on of that name that is still live)."""
        doc = await self.store.get_doc(kinds.OPERATOR, name)
        if doc is None or doc["token_hash"] != digest:
            signed_in = await self._signed_in(digest, name, now)
            if signed_in is not None:
                return signed_in
        if doc is None or doc.get("revoked_at") or not secrets.compare_digest(doc["token_hash"], digest):
            return None
        if doc.get("expires_at") is not None and doc["expires_at"] <= now:
            return None
        return Operator(name, frozenset(doc["roles"]), "token", digest)

    # -- single sign-on: a person the OpenID provider vouched for, for a while -------------------------------
    async def sign_in(self, name: str, roles: tuple[str, ...], ttl_s: float, subject: str, issuer: str) -> tuple[
            str, Operator]:
        """A token for a person the provider signed in (returned once, kept as its hash) and who it proves:
        ``name`` with the provider's roles, ``via: oidc``, until ``ttl_s`` from now or ``operators revoke``."""
        now = self.clock()
        await self._claim_name(name, subject, issuer, now)
        token = _new_token()
        digest = token_hash(token)
        await self.store.put_doc(kinds.OIDC_SIGN_IN, digest, {
            "token_hash": digest, "name": name, "roles": list(roles), "subject": subject, "issuer": issuer,
            "created_at": now, "expires_at": now + ttl_s, "revoked_at": None})
        self.metrics.inc("tether_operator_sign_ins_total")
        return token, Operator(name, frozenset(roles), VIA_OIDC, digest)

    async def _claim_name(self, name: str, subject: str, issuer: str, now: float) -> None:
        """A name is one person's: the provider account that first signed in under it, and never a token
        operator's. Providers often let users choose the claim tether names them by; without this a user
        who chose ``alice`` would be attributed alice's decisions and share her separation of duties."""
        held = await self.store.get_doc(kinds.OPERATOR, name)
        if held is not None and not held.get("revoked_at"):
            raise ApiError(403, FORBIDDEN, f"the name {name} belongs to an operator with a token: a single sign-on "
                           "may not take it (ask an admin to revoke that operator first, or sign in under another "
                           "name claim)", reason="name_held_by_token_operator", operator=name)
        owner = {"name": name, "subject": subject, "issuer": issuer, "first_at": now, "version": 1}
        for _ in range(2):  # create it, or read the one another replica created at the same moment
            bound = await self.store.get_doc(kinds.OIDC_NAME, name)
            if bound is None and await self.store.cas_doc(kinds.OIDC_NAME, name, 0, owner):
                return
            if bound is not None:
                if (bound["issuer"], bound["subject"]) != (issuer, subject):
                    raise ApiError(403, FORBIDDEN, f"the name {name} belongs to another account of the provider "
                                   "(signed in first with another subject): it is not yours to take",
                                   reason="name_taken", operator=name)
                return
        raise ApiError(409, CONFLICT, f"the name {name} is being claimed by another sign-in; try again")

    async def _signed_in(self, digest: str, name: str | None, now: float) -> Operator | None:
        doc = await self.store.get_doc(kinds.OIDC_SIGN_IN, digest)
        if doc is None or doc.get("revoked_at") or doc["expires_at"] <= now or name not in (None, doc["name"]):
            return None
        return Operator(doc["name"], frozenset(doc["roles"]), VIA_OIDC, digest)

    async def _end_sign_ins(self, name: str, now: float) -> list[Doc]:
        """Every live single sign-on of ``name``, ended; the ones that were live."""
        ended = []
        for doc in await self.store.list_docs(kinds.OIDC_SIGN_IN):
            if doc["name"] == name and not doc.get("revoked_at") and doc["expires_at"] > now:
                await self.store.put_doc(kinds.OIDC_SIGN_IN, doc["token_hash"], {**doc, "revoked_at": now})
                ended.append(doc)
        return ended

    # -- changes, each recorded in the operator's history ----------------------------------------------------
    async def add(self, name: str, roles: list[Any], expires_in_s: float | None, by: Operator) -> Doc:
        name, roles = check_name(name), check_roles(roles)
        now = self.clock()
        old = await self.store.get_doc(kinds.OPERATOR, name)
        if old is not None and not old.get("revoked_at"):
            raise ApiError(409, CONFLICT, f"operator {name} exists; rotate its token or revoke it first")
        bound = await self.store.get_doc(kinds.OIDC_NAME, name)
        if bound is not None:
            raise ApiError(409, CONFLICT, f"the name {name} belongs to a person who signs in through the provider "
                           f"({bound['issuer']}); give the token operator another name", field="name")
        token = _new_token()
        history = (old or {}).get("history", [])
        doc = {"name": name, "roles": roles, "token_hash": token_hash(token), "created_at": now,
               "lifetime_s": expires_in_s, "expires_at": now + expires_in_s if expires_in_s else None,
               "rotated_at": None, "revoked_at": None,
               "history": [*history, {"action": ADDED, "roles": roles, **by.attribution(now)}],
               "version": (old["version"] if old else 0) + 1}
        await self._write(doc, old)
        self.metrics.inc("tether_operator_changes_total")
        return {**view(doc, now), "token": token}

    async def rotate(self, name: str, expires_in_s: float | None, by: Operator) -> Doc:
        old = await self._live(name)
        now = self.clock()
        lifetime = expires_in_s if expires_in_s is not None else old.get("lifetime_s")
        token = _new_token()
        doc = {**old, "token_hash": token_hash(token), "rotated_at": now, "lifetime_s": lifetime,
               "expires_at": now + lifetime if lifetime else None,
               "history": [*old["history"], {"action": ROTATED, **by.attribution(now)}],
               "version": old["version"] + 1}
        await self._write(doc, old)
        self.metrics.inc("tether_operator_changes_total")
        return {**view(doc, now), "token": token}

    async def revoke(self, name: str, by: Operator) -> Doc:
        """Revoke an operator's token, and end every live single sign-on of that name."""
        now = self.clock()
        ended = await self._end_sign_ins(name, now)
        doc = await self.store.get_doc(kinds.OPERATOR, name)
        if (doc is None or doc.get("revoked_at")) and ended:  # a person known only through the provider
            return {"name": name, "roles": sorted({r for d in ended for r in d["roles"]}), "status": "revoked",
                    "created_at": min(d["created_at"] for d in ended), "expires_at": None, "rotated_at": None,
                    "revoked_at": now, "history": [{"action": REVOKED, "sign_ins_ended": len(ended),
                                                    **by.attribution(now)}]}
        old = await self._live(name)
        doc = {**old, "revoked_at": now, "history": [*old["history"], {"action": REVOKED, **by.attribution(now)}],
               "version": old["version"] + 1}
        await self._write(doc, old)
        self.metrics.inc("tether_operator_changes_total")
        return view(doc, now)

    async def list(self) -> list[Doc]:
        now = self.clock()
        return sorted((view(d, now) for d in await self.store.list_docs(kinds.OPERATOR)), key=lambda d: d["name"])

    async def _live(self, name: str) -> Doc:
        doc = await self.store.get_doc(kinds.OPERATOR, name)
        if doc is None or doc.get("revoked_at"):
            raise ApiError(404, NOT_FOUND, f"no operator {name}" + (" (it was revoked)" if doc else ""))
        return doc

    async def _write(self, doc: Doc, old: Doc | None) -> None:
        # The pointer first: a token whose operator document never got its hash proves nobody.
        await self.store.put_doc(kinds.OPERATOR_TOKEN, doc["token_hash"], {"name": doc["name"]})
        if not await self.store.cas_doc(kinds.OPERATOR, doc["name"], old["version"] if old else 0, doc):
            raise ApiError(409, CONFLICT, f"operator {doc['name']} was changed concurrently; look again and retry")


def _new_token() -> str:
    return "tether_op_" + secrets.token_urlsafe(32)
