"""Who is calling the control plane: an operator (a bearer token or a console session) or a chain holder
(a signed proof).

Operators are named people with roles (``ROLES``): the bootstrap admin (``TETHER_ADMIN_TOKEN``, named
``admin``) and those ``tether operators add`` made, whose tokens the store keeps only as SHA-256 hashes
(a token is 256 random bits: a fast hash is enough, nothing can be guessed from it). Tokens compare in
constant time. A proof names the link whose ``cnf`` key signed it; the server checks that key, the request
it signs, its freshness, and that its ``jti`` was not seen before.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from tether.capability import keys, protocol
from tether.capability.errors import BAD_REQUEST, FORBIDDEN, UNAUTHORIZED, ApiError
from tether.capability.proof import MAX_AGE_S, Proof, check_fresh, check_signed, read_proof

from .store import Doc, Store

PROOF_HEADER = protocol.PROOF_HEADER
SESSION_COOKIE = "tether_session"  # over plain HTTP
TLS_SESSION_COOKIE = "__Host-tether_session"  # over TLS: Secure, host-only, Path=/
CSRF_HEADER = "X-CSRF-Token"
CSRF = "tether.csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


# An operator's roles. Every role reads everything; each of the others adds what it names; admin is all.
VIEWER, APPROVER, RESPONDER, ADMIN_ROLE = "viewer", "approver", "responder", "admin"
ROLES = (VIEWER, APPROVER, RESPONDER, ADMIN_ROLE)
READ = frozenset(ROLES)  # what a route that only reads allows
APPROVE = frozenset({APPROVER, ADMIN_ROLE})  # decide held calls
RESPOND = frozenset({RESPONDER, ADMIN_ROLE})  # revoke, terminate
ADMINISTER = frozenset({ADMIN_ROLE})  # grants, chains, operators
BOOTSTRAP = "admin"  # the name TETHER_ADMIN_TOKEN acts under; no operator may take it
VIA_TOKEN = "token"


def token_hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.strip().encode()).hexdigest()


@dataclass(frozen=True)
class Operator:
    """A person acting on the control plane: the name decisions carry, the roles, and how they signed in."""

    name: str
    roles: frozenset[str]
    via: str = VIA_TOKEN
    token_hash: str = ""  # the token this identity was proven with (a session ends when it is rotated)

    def may(self, allowed: frozenset[str]) -> bool:
        return bool(self.roles & allowed)

    def attribution(self, at: float | None = None) -> dict[str, Any]:
        """What a decision records of who made it."""
        out: dict[str, Any] = {"operator": self.name, "via": self.via}
        if at is not None:
            out["at"] = at
        return out


def needed_roles(allowed: frozenset[str]) -> str:
    """The role a refusal names: the narrowest that would do, and admin (which does everything) after it."""
    narrow = [r for r in ROLES if r in allowed and r != ADMIN_ROLE]
    return f"the {' or '.join(narrow)} role (or admin)" if narrow else "the admin role"


class SessionTable(Protocol):
    """The console's server-side sessions (``tether/controlplane/console/sessions.py``)."""

    cookie: str  # the cookie's name: TLS_SESSION_COOKIE when the console is served over TLS

    def get(self, sid: str, now: float) -> Any: ...  # a session with ``csrf`` and ``operator``, or None


class OperatorDirectory(Protocol):
    """The operators ``tether operators`` manages (``tether/controlplane/services/operators.py``)."""

    async def by_token(self, token: str, now: float) -> Operator | None: ...

    async def current(self, name: str, token_hash: str, now: float) -> Operator | None: ...


@dataclass(frozen=True)
class Caller:
    """Who signed a request: the agent, the registered link whose key signed it, and the sidecar run (if
    any). Commands, acknowledgements, heartbeats and in-flight lists belong to a run of a link."""

    agent: str
    link: Doc
    run: str | None

    @property
    def link_hash(self) -> str:
        return self.link["hash"]


class ReplayCache:
    """Proof jtis seen within the freshness window. Bounded; oldest forgotten first."""

    def __init__(self, window_s: float = 2 * MAX_AGE_S, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_use(self, jti: str, now: float) -> bool:
        while self._seen:
            _oldest, at = next(iter(self._seen.items()))
            if at >= now - self.window_s and len(self._seen) < self.max_entries:
                break
            self._seen.popitem(last=False)
        if jti in self._seen:
            return False
        self._seen[jti] = now
        return True


class ProofClock(Protocol):
    """What the replica's clock watch (``tether/controlplane/services/clock.py``) takes from verified proofs."""

    def proof_seen(self, run: str, now: float, iat: float) -> None: ...

    def skew_reason(self) -> str: ...  # empty unless this replica's clock is skewed

    def reference_now(self, now: float) -> float: ...  # ``now`` on the store's clock, as measured


class Authenticator:
    def __init__(self, store: Store, admin_token: str, clock=time.time) -> None:
        self.store = store
        self.admin_token = admin_token.encode()
        self.clock = clock
        self.replays = ReplayCache()
        self.sessions: SessionTable | None = None  # set when the console is installed
        self.operators: OperatorDirectory | None = None  # set by the control plane
        self.proof_clock: ProofClock | None = None  # set by the control plane: proofs' ages measure this clock
        # Registered links never change (a link is named by the hash of its content, and registering it
        # again leaves it as it was), so each replica keeps the ones its sidecars sign with: one store round
        # trip less on every heartbeat, report batch and stream connect.
        self._links: OrderedDict[str, Doc] = OrderedDict()
        self.max_links = 100_000

    def bootstrap(self) -> Operator:
        return Operator(BOOTSTRAP, frozenset({ADMIN_ROLE}), VIA_TOKEN, token_hash(self.admin_token.decode()))

    async def operator(self, request: web.Request) -> Operator | None:
        """The operator a request proves: its bearer token's, else its console session's; None for neither.
        A change made with a session must carry the session's CSRF token (``tether.csrf`` otherwise)."""
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            who = await self.by_token(header[len("Bearer "):])
            if who is not None:
                return who
        return await self.session_operator(request)

    async def by_token(self, token: str) -> Operator | None:
        token = token.strip()
        if not token:
            return None
        if self.admin_token and hmac.compare_digest(token.encode(), self.admin_token):
            return self.bootstrap()
        return await self.operators.by_token(token, self.clock()) if self.operators is not None else None

    def _session_id(self, request: web.Request) -> str:
        return request.cookies.get(self.sessions.cookie, "") if self.sessions is not None else ""

    async def session_operator(self, request: web.Request) -> Operator | None:
        """A live console session acts as the operator who signed it in, while that operator's token is still
        theirs (a revoked or rotated token ends its sessions). A state change made with it must carry the
        session's CSRF token: the cookie alone is what a forged cross-site request would carry."""
        sid = self._session_id(request)
        if self.sessions is None or not sid:
            return None
        now = self.clock()
        session = self.sessions.get(sid, now)
        if session is None:
            return None
        who = await self.still_valid(session.operator, now)
        if who is None:
            return None
        if request.method not in SAFE_METHODS:
            sent = request.headers.get(CSRF_HEADER, "")
            if not sent or not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                raise ApiError(403, CSRF, f"a change made with a console session needs its {CSRF_HEADER} header; "
                               "reload the console")
        return who

    async def still_valid(self, who: Operator, now: float) -> Operator | None:
        if who.name == BOOTSTRAP:
            return who if self.admin_token and hmac.compare_digest(who.token_hash.encode(),
                                                                   self.bootstrap().token_hash.encode()) else None
        if self.operators is None:
            return None
        return await self.operators.current(who.name, who.token_hash, now)

    async def require(self, request: web.Request, allowed: frozenset[str], what: str) -> Operator:
        """The operator calling, if their roles allow ``what``; 401 without credentials, 403 otherwise."""
        who = await self.operator(request)
        if who is None:
            if "Authorization" in request.headers:
                raise ApiError(403, FORBIDDEN, "the bearer token is not an operator's (TETHER_TOKEN) nor the admin "
                               "token, or it was revoked")
            raise ApiError(401, UNAUTHORIZED, "operators only: send Authorization: Bearer $TETHER_TOKEN (or "
                           "$TETHER_ADMIN_TOKEN)")
        return self.allow(who, allowed, what)

    @staticmethod
    def allow(who: Operator, allowed: frozenset[str], what: str) -> Operator:
        if not who.may(allowed):
            raise ApiError(403, FORBIDDEN, f"{who.name} ({', '.join(sorted(who.roles))}) may not {what}: it needs "
                           f"{needed_roles(allowed)}", needs=[r for r in ROLES if r in allowed],
                           operator=who.name)
        return who

    def proof_of(self, request: web.Request) -> Proof | None:
        header = request.headers.get(PROOF_HEADER)
        return read_proof(header) if header else None

    async def check(self, request: web.Request, proof: Proof, key_jwk: dict, body: bytes, consume: bool = True) -> None:
        """Verify the proof for this request; ``consume`` marks it used (off when the same request is checked
        against several links)."""
        now = self.clock()
        check_signed(proof, keys.from_jwk(key_jwk), method=request.method, path=request.path_qs, body=body)
        try:  # judged on the store's clock: a replica's own error moves no proof in or out of its window
            check_fresh(proof, now=self.proof_clock.reference_now(now) if self.proof_clock is not None else now)
        except ApiError as exc:
            skew = self.proof_clock.skew_reason() if self.proof_clock is not None else ""
            if skew:  # the fault may be this replica's, not the signer's: say so
                raise ApiError(exc.http_status, exc.code, f"{exc.message} ({skew})") from None
            raise
        if not consume:
            return
        # Locally first (cheap), then in the store, so a proof replayed to another replica is refused too.
        if not self.replays.first_use(proof.jti, now) or not await self.store.first_use(
            f"proof:{proof.jti}", self.replays.window_s, now
        ):
            raise ApiError(401, UNAUTHORIZED, "Tether-Proof was already used; sign each request afresh")
        if self.proof_clock is not None and proof.run is not None:
            # A sidecar's fresh, first-used proof: its signing time is that sidecar's clock, worth comparing this
            # one with (a replayed or stale proof is not: anyone holding one could skew the comparison).
            self.proof_clock.proof_seen(proof.run, now, float(proof.claims["iat"]))

    async def sidecar(self, request: web.Request, body: bytes) -> Caller:
        """Authenticate a chain holder by its registered leaf link (and the sidecar run it names)."""
        proof = self.proof_of(request)
        if proof is None or not proof.link:
            raise ApiError(401, UNAUTHORIZED, f"sign the request with your chain's key ({PROOF_HEADER} header)")
        link = self._links.get(proof.link)
        if link is None:
            link = await self.store.get_link(proof.link)
            if link is None:
                raise ApiError(401, UNAUTHORIZED,
                               "the link named by the proof is not registered; register the chain first")
            self._links[proof.link] = link
            if len(self._links) > self.max_links:
                self._links.popitem(last=False)
        if link["sub"] != proof.agent:
            raise ApiError(401, UNAUTHORIZED, "the proof's subject does not hold the link it names")
        await self.check(request, proof, link["claims"]["cnf"]["jwk"], body)
        return Caller(proof.agent, link, proof.run)

    async def run_of(self, request: web.Request, body: bytes) -> Caller:
        """A sidecar run: a chain holder whose proof names its run (heartbeats, acknowledgements)."""
        caller = await self.sidecar(request, body)
        if caller.run is None:
            raise ApiError(400, BAD_REQUEST, "this request belongs to a sidecar run: sign it with a 'run' claim")
        # A run belongs to the link that first spoke for it. Another link naming it (its id shows in records,
        # `tether agents` and traces) could otherwise acknowledge, heartbeat or settle slices in its name.
        run = await self.store.get_sidecar(caller.run)
        if run is None:
            await self.store.put_sidecar(caller.run, {"run_id": caller.run, "agent": caller.agent,
                                                      "link": caller.link_hash, "bound_at": self.clock()})
        elif run.get("link") != caller.link_hash:
            raise ApiError(403, FORBIDDEN, f"run {caller.run} belongs to another link; a sidecar signs its own run")
        return caller
