"""The console's sign-in sessions and the throttle on wrong tokens.

Sessions are server-side, each with an expiry, its own CSRF token and the operator who signed it in.
Pure: no clock of its own (``now`` is passed in) and no I/O. A session id is the only thing the browser
holds (in an HttpOnly cookie); the CSRF token is handed to the page, which echoes it on every change.
Sessions live in the replica that made them: with several replicas, route a browser to one (sticky).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass

from ..auth import SESSION_COOKIE, TLS_SESSION_COOKIE, Operator

DEFAULT_TTL_S = 8 * 3600.0
MAX_SESSIONS = 1000


@dataclass(frozen=True)
class Session:
    sid: str
    csrf: str
    created_at: float
    expires_at: float
    operator: Operator  # who signed in; the session acts as them while their token is theirs


class Sessions:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_sessions: int = MAX_SESSIONS, tls: bool = False) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        # Over TLS the cookie is ``__Host-`` prefixed: the browser keeps it only if it is Secure, host-only and
        # for Path=/, and sends it only over TLS, so a plain-HTTP listener on another port of the host never
        # receives it (cookies are scoped by host, not port).
        self.tls = tls
        self.cookie = TLS_SESSION_COOKIE if tls else SESSION_COOKIE
        self._live: OrderedDict[str, Session] = OrderedDict()

    def create(self, now: float, operator: Operator) -> Session:
        self._expire(now)
        while len(self._live) >= self.max_sessions:  # the oldest sign-in goes first
            self._live.popitem(last=False)
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now, now + self.ttl_s, operator)
        self._live[session.sid] = session
        return session

    def get(self, sid: str, now: float) -> Session | None:
        session = self._live.get(sid)
        if session is None:
            return None
        if session.expires_at <= now:
            del self._live[sid]
            return None
        return session

    def end(self, sid: str) -> bool:
        return self._live.pop(sid, None) is not None

    def _expire(self, now: float) -> None:
        for sid in [s.sid for s in self._live.values() if s.expires_at <= now]:
            del self._live[sid]


class SignInThrottle:
    """Wrong tokens at sign-in, per source address, with exponential backoff: after ``free`` wrong tokens
    within ``memory_s``, that source waits ``base_wait_s`` before a guessable token is checked again, and each
    further wrong one doubles the wait (30 s, 60 s, 120 s ... at most ``max_wait_s``). Bounded: the table
    forgets the oldest sources first.

    The throttle never stands between an operator and a token that cannot be guessed: a token minted by
    ``tether operators add`` (256 random bits), or a bootstrap admin token of at least ``STRONG_CHARS``
    characters, signs in whatever the throttle says (the console checks it first), so no local process can
    lock its rightful holder out by failing on purpose. Only a short admin token, which guessing could find,
    waits out the backoff like a wrong one."""

    STRONG_CHARS = 20

    def __init__(self, free: int = 10, memory_s: float = 3600.0, base_wait_s: float = 30.0,
                 max_wait_s: float = 900.0, max_clients: int = 10_000) -> None:
        self.free = free
        self.base_wait_s = base_wait_s
        self.memory_s = memory_s
        self.max_wait_s = max_wait_s
        self.max_clients = max_clients
        self._failures: OrderedDict[str, list[float]] = OrderedDict()

    def retry_after(self, client: str, now: float) -> float:
        """Seconds this source must still wait before a guessable token is checked; 0 when it may try."""
        recent = [t for t in self._failures.get(client, []) if t > now - self.memory_s]
        if len(recent) < self.free:
            return 0.0
        wait = min(self.max_wait_s, self.base_wait_s * 2.0 ** (len(recent) - self.free))
        return max(0.0, recent[-1] + wait - now)

    def failed(self, client: str, now: float) -> None:
        recent = [t for t in self._failures.pop(client, []) if t > now - self.memory_s]
        self._failures[client] = [*recent, now][-(self.free + 16):]  # enough to reach the longest wait
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)
