"""Who is calling the control plane: an admin (bearer token) or a chain holder (signed proof).

Admin tokens compare in constant time. A proof names the link whose ``cnf`` key signed it; the server
checks that key, the request it signs, its freshness, and that its ``jti`` was not seen before.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from capability import keys
from capability.errors import BAD_REQUEST, FORBIDDEN, UNAUTHORIZED, ApiError
from capability.proof import MAX_AGE_S, Proof, check_fresh, check_signed, read_proof

from .store import Doc, Store

PROOF_HEADER = "Tether-Proof"
SESSION_COOKIE = "tether_session"
CSRF_HEADER = "X-CSRF-Token"
CSRF = "tether.csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class SessionTable(Protocol):
    """The console's server-side sessions (``controlplane/console/sessions.py``)."""

    def get(self, sid: str, now: float) -> Any: ...  # a session with a ``csrf`` attribute, or None


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
    """What the replica's clock watch (``controlplane/services/clock.py``) takes from verified proofs."""

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
        self.proof_clock: ProofClock | None = None  # set by the control plane: proofs' ages measure this clock
        # Registered links never change (a link is named by the hash of its content, and registering it
        # again leaves it as it was), so each replica keeps the ones its sidecars sign with: one store round
        # trip less on every heartbeat, report batch and stream connect.
        self._links: OrderedDict[str, Doc] = OrderedDict()
        self.max_links = 100_000

    def is_admin(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and self.admin_token:
            return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), self.admin_token)
        return self.session_admin(request)

    def session_admin(self, request: web.Request) -> bool:
        """A live console session acts as admin. A state change made with it must carry the session's CSRF
        token: the cookie alone is what a forged cross-site request would carry, the token it cannot read."""
        sid = request.cookies.get(SESSION_COOKIE)
        if self.sessions is None or not sid:
            return False
        session = self.sessions.get(sid, self.clock())
        if session is None:
            return False
        if request.method not in SAFE_METHODS:
            sent = request.headers.get(CSRF_HEADER, "")
            if not sent or not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                raise ApiError(403, CSRF, f"a change made with a console session needs its {CSRF_HEADER} header; "
                               "reload the console")
        return True

    def require_admin(self, request: web.Request) -> None:
        if not self.is_admin(request):
            if "Authorization" in request.headers:
                raise ApiError(403, FORBIDDEN, "the bearer token is not the admin token")
            raise ApiError(401, UNAUTHORIZED, "admin only: send Authorization: Bearer $TETHER_ADMIN_TOKEN")

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
