"""Every refusal tether can make, as a typed exception with a stable code.

Codes are part of the contract (docs/contract.md section 5): outside checks match on them, so a code never
changes once shipped. Chain failures carry a sub-reason (``bad_signature``, ``widened_capability`` ...)
that says which rule broke.
"""

from __future__ import annotations

from typing import Any

# Codes a sidecar answers with (docs/contract.md section 5).
CAPABILITY_ABSENT = "tether.capability_absent"
UNKNOWN_DESTINATION = "tether.unknown_destination"
CHAIN_INVALID = "tether.chain_invalid"
CHAIN_REVOKED = "tether.chain_revoked"
CHAIN_EXPIRED = "tether.chain_expired"
LEASE_EXPIRED = "tether.lease_expired"
DRAINING = "tether.draining"
TERMINATED = "tether.terminated"
APPROVAL_DENIED = "tether.approval_denied"
APPROVAL_TIMEOUT = "tether.approval_timeout"
CAPTURE_UNAVAILABLE = "tether.capture_unavailable"
CREDENTIAL_UNAVAILABLE = "tether.credential_unavailable"  # docs/contract.md section 10: no secret, no token
# Budgets (docs/contract.md section 10): no slice of a capability's calls budget, or its rate window, is left.
BUDGET_EXHAUSTED = "tether.budget_exhausted"
RATE_LIMITED = "tether.rate_limited"
# The call's start cannot be written ahead to the spool (a full disk): it is refused, never sent unrecorded.
SPOOL_UNAVAILABLE = "tether.spool_unavailable"
# The sidecar itself is stopping (SIGTERM, the end of `tether run`, a pod stop): it admits nothing new.
STOPPING = "tether.stopping"

# Codes of our own, for input that is not a call (catalog files, API requests, CLI arguments).
CATALOG_INVALID = "tether.catalog_invalid"
UNKNOWN_CAPABILITY = "tether.unknown_capability"
BAD_REQUEST = "tether.bad_request"
UNAUTHORIZED = "tether.unauthorized"
FORBIDDEN = "tether.forbidden"
NOT_FOUND = "tether.not_found"
CONFLICT = "tether.conflict"
STORE_UNAVAILABLE = "tether.store_unavailable"
STORE_UNWRITABLE = "tether.store_unwritable"  # the store answers but refuses writes (disk full, Redis OOM ...)
CLOCK_SKEWED = "tether.clock_skewed"  # a replica whose clock is off past the bound: it fixes no deadline
ISOLATION_UNAVAILABLE = "tether.isolation_unavailable"  # tether run cannot enforce here (and no --cooperative)
CONTROLPLANE_UNREACHABLE = "tether.controlplane_unreachable"
KEY_INVALID = "tether.key_invalid"
LISTEN_FAILED = "tether.listen_failed"  # a sidecar or control plane that cannot listen where it was told
FILE_EXISTS = "tether.file_exists"  # a key (or other file tether creates) is already there: never overwritten
SIGNING_KEY_MISMATCH = "tether.signing_key_mismatch"  # the signing key did not sign the record log it would extend
CLIENT_CANCELLED = "tether.client_cancelled"  # the agent cancelled a held call before its decision: it never left
MCP_SESSION_UNKNOWN = "tether.mcp_session_unknown"  # an Mcp-Session-Id this sidecar run did not see issued
CREDENTIAL_REQUIRES_TLS = "tether.credential_requires_tls"  # an injected credential goes only over verified TLS
# An approval-tier call whose body is past what an approver is shown whole (or has no end in sight): refused.
APPROVAL_BODY_TOO_LARGE = "tether.approval_body_too_large"
# A sidecar run (or link) already has as many calls waiting for a person as the control plane keeps.
APPROVAL_QUEUE_FULL = "tether.approval_queue_full"


def escape_unprintable(text: str, keep: str = "\n") -> str:
    """``text`` with every character that is not printable (control characters such as the ESC of terminal
    escapes, lone surrogates that no encoder accepts, bidi overrides) written as a Python escape, except
    those in ``keep``. Messages quote untrusted input (a link's claims, a request's fields); printing or
    logging one must neither crash nor drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)


class TetherError(Exception):
    """Base of every tether refusal. ``code`` is stable; ``message`` says what to do about it."""

    code: str = "tether.error"
    http_status: int = 400
    keep_in_message = "\n"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        message = escape_unprintable(str(message), self.keep_in_message)
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        body.update({k: v for k, v in self.details.items() if v is not None})
        return body

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class CatalogError(TetherError):
    """The catalog file is not valid; the message names the file, the capability and the field."""

    code = CATALOG_INVALID


class UnknownCapability(TetherError):
    code = UNKNOWN_CAPABILITY


class KeyError_(TetherError):
    code = KEY_INVALID


class ChainError(TetherError):
    """A chain that must not be trusted. ``reason`` names the rule that failed; ``link`` its index."""

    code = CHAIN_INVALID
    http_status = 403
    keep_in_message = ""  # one line each: nothing a link carries may start another line of a log

    def __init__(self, reason: str, message: str, *, link: int | None = None, **details: Any) -> None:
        super().__init__(message, reason=reason, link=link, **details)
        self.reason = reason
        self.link = link


class ChainInvalid(ChainError):
    code = CHAIN_INVALID


class ChainRevoked(ChainError):
    code = CHAIN_REVOKED

    def __init__(self, message: str, *, link: int | None = None, jti: str | None = None) -> None:
        super().__init__("revoked", message, link=link, jti=jti)


class ChainExpired(ChainError):
    code = CHAIN_EXPIRED

    def __init__(self, reason: str, message: str, *, link: int | None = None) -> None:
        super().__init__(reason, message, link=link)


class ApiError(TetherError):
    """An HTTP API refusal from the control plane."""

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message, code=code, **details)
        self.http_status = status
