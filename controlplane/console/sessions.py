"""The console's sign-in sessions: server-side, each with an expiry and its own CSRF token.

Pure: no clock of its own (``now`` is passed in) and no I/O. A session id is the only thing the browser
holds (in an HttpOnly cookie); the CSRF token is handed to the page, which echoes it on every change.
Sessions live in the replica that made them: with several replicas, route a browser to one (sticky).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_TTL_S = 8 * 3600.0
MAX_SESSIONS = 1000


@dataclass(frozen=True)
class Session:
    sid: str
    csrf: str
    created_at: float
    expires_at: float


class Sessions:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._live: OrderedDict[str, Session] = OrderedDict()

    def create(self, now: float) -> Session:
        self._expire(now)
        while len(self._live) >= self.max_sessions:  # the oldest sign-in goes first
            self._live.popitem(last=False)
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now, now + self.ttl_s)
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
    """Wrong admin tokens, per client address: after ``limit`` within ``window_s`` the address must wait out
    the window before it may try again (the right token included), so the token cannot be guessed at line
    speed. Bounded: the table forgets the oldest addresses first."""

    def __init__(self, limit: int = 10, window_s: float = 60.0, max_clients: int = 10_000) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self._failures: OrderedDict[str, list[float]] = OrderedDict()

    def retry_after(self, client: str, now: float) -> float:
        """Seconds this client must still wait; 0 when it may try."""
        recent = [t for t in self._failures.get(client, []) if t > now - self.window_s]
        if len(recent) < self.limit:
            return 0.0
        return recent[-self.limit] + self.window_s - now

    def failed(self, client: str, now: float) -> None:
        recent = [t for t in self._failures.pop(client, []) if t > now - self.window_s]
        self._failures[client] = [*recent, now][-self.limit:]
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)
