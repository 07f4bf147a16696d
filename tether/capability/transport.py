"""The client core: how a request to the control plane is made and how its answer is read, whatever carries it.

Two transports carry tether's requests: the sidecar's (async, aiohttp, ``tether/proxy/channel.py``) and the
CLI's (sync, the standard library, ``tether/controlplane/client.py``). What a request means is the same for
both and lives here, with no I/O, as httpx keeps its models apart from its transports:

- ``prepare``: the body encoded once, signed (a ``Tether-Proof`` over the body as the control plane reads it)
  or carrying an operator's bearer token, and gzip-compressed past a size;
- ``read_answer``: the answer's JSON, or the refusal it carries as an ``ApiError`` with the control plane's
  code, message and details (``Tether-Error`` and the JSON ``error``), or a plain ``tether.http_error`` for an
  answer no tether control plane gave;
- ``unreachable``: the one error for "no answer at all", in the words every start-up line uses;
- ``retryable`` and ``backoff_s``: which failures are worth another try, and how long to wait before it.

A transport only moves bytes: it sends ``Prepared.body`` with ``Prepared.headers`` to ``Prepared.url`` and hands
the status, body and content type back to ``read_answer``.
"""

from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .errors import CONTROLPLANE_UNREACHABLE, ApiError
from .proof import make_proof
from .protocol import PROOF_HEADER

HTTP_ERROR = "tether.http_error"  # an answer that is no tether control plane's (a wrong URL, a proxy's page)
BAD_RESPONSE = "tether.bad_response"  # a tether answer that is not the JSON it must be
JSON = "application/json"


@dataclass(frozen=True)
class Signer:
    """Signs requests as a chain holder: the agent, the hash of its leaf link, the link's key, and (for a
    sidecar) the run it speaks for."""

    agent: str
    link: str
    key: Ed25519PrivateKey
    run: str | None = None


@dataclass(frozen=True)
class Prepared:
    """A request ready to send: ``body`` as it goes on the wire (maybe compressed), ``headers`` to send with it."""

    method: str
    url: str
    path: str
    body: bytes
    headers: dict[str, str]


def prepare(base_url: str, method: str, path: str, body: Any = None, *, encoded: bytes | None = None,
            signer: Signer | None = None, bearer: str | None = None, compress_above: int | None = None,
            now: Callable[[], float] = time.time) -> Prepared:
    """The request for ``method path``: ``body`` JSON-encoded (or ``encoded``, bytes the caller has already),
    signed by ``signer`` or else carrying ``bearer``; compressed when longer than ``compress_above`` (the proof
    signs the body as the control plane reads it: decompressed)."""
    data = encoded if encoded is not None else b"" if body is None else json.dumps(body).encode()
    headers = {"Content-Type": JSON, "Accept": JSON}
    if signer is not None:
        headers[PROOF_HEADER] = make_proof(signer.key, agent=signer.agent, method=method, path=path, body=data,
                                           now=now(), link=signer.link, run=signer.run)
    elif bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    if compress_above is not None and len(data) > compress_above:
        data = gzip.compress(data, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return Prepared(method, base_url.rstrip("/") + path, path, data, headers)


def read_answer(status: int, raw: bytes, content_type: str | None, what: str, *, text_ok: bool = False) -> Any:
    """What an answer says: its JSON document (None for an empty body), its text when ``text_ok`` and it is not
    JSON (``/metrics``), or the refusal it carries, raised as an ``ApiError``."""
    if status >= 400:
        raise refusal(status, _json_or_none(raw), what)
    if not raw:
        return None
    if text_ok and "json" not in (content_type or ""):
        return raw.decode(errors="replace")
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError(status, BAD_RESPONSE, f"{what}: not JSON (HTTP {status})") from None


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def refusal(status: int, doc: Any, what: str) -> ApiError:
    """The control plane's refusal (``{"error": {"code", "message", ...details}}``) as an ``ApiError``; an answer
    shaped otherwise says where it came from."""
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        return ApiError(status, HTTP_ERROR, f"{what}: HTTP {status}, not a tether control plane's answer "
                        "(is the URL right?)")
    details = {k: v for k, v in err.items() if k not in ("code", "message")}
    return ApiError(status, err["code"], str(err.get("message") or f"HTTP {status}"), **details)


def unreachable(base_url: str, reason: str) -> ApiError:
    """No answer at all: the control plane is down, too slow, or the URL leads nowhere."""
    return ApiError(503, CONTROLPLANE_UNREACHABLE, f"control plane {base_url.rstrip('/')} unreachable: {reason}")


def retryable(exc: BaseException) -> bool:
    """Worth another try later: no answer came. A refusal is the control plane's decision, and bad input stays
    bad (the caller reports it, never retries it)."""
    return isinstance(exc, ApiError) and exc.code == CONTROLPLANE_UNREACHABLE


def backoff_s(attempt: int, cap_s: float = 2.0, jitter: Callable[[float, float], float] = random.uniform) -> float:
    """Exponential, with jitter: a fleet that lost its replica at once must not come back at once."""
    return min(cap_s, 0.1 * 2 ** min(attempt, 6)) * jitter(0.5, 1.0)
