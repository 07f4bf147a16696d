"""A small synchronous client for the control plane API, used by the CLI (stdlib only)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability.errors import CONTROLPLANE_UNREACHABLE, ApiError
from tether.capability.proof import make_proof

DEFAULT_URL = "http://127.0.0.1:7000"
UNREACHABLE = CONTROLPLANE_UNREACHABLE


@dataclass
class Signer:
    """Signs requests as a chain holder: the agent, the hash of its leaf link, the link's key, and (for a
    sidecar) the run it speaks for."""

    agent: str
    link: str
    key: Ed25519PrivateKey
    run: str | None = None


class Client:
    def __init__(self, url: str | None = None, admin_token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("TETHER_CONTROLPLANE") or DEFAULT_URL).rstrip("/")
        # An operator's token (TETHER_TOKEN, from `tether operators add`), else the bootstrap admin's.
        self.admin_token = admin_token if admin_token is not None else (
            os.environ.get("TETHER_TOKEN") or os.environ.get("TETHER_ADMIN_TOKEN", ""))
        self.timeout = timeout

    def request(
        self, method: str, path: str, body: Any = None, *, signer: Signer | None = None, admin: bool = True
    ) -> Any:
        data = b"" if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if signer is not None:
            headers["Tether-Proof"] = make_proof(
                signer.key, agent=signer.agent, method=method, path=path, body=data, now=time.time(),
                link=signer.link, run=signer.run)
        elif admin and self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        req = urllib.request.Request(
            self.url + path, data=data if method != "GET" else None, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
                ctype = resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                err = json.loads(raw)["error"]
                details = {k: v for k, v in err.items() if k not in ("code", "message")}
                raise ApiError(exc.code, err["code"], err["message"], **details) from None
            except (ValueError, KeyError, TypeError):
                raise ApiError(exc.code, "tether.http_error", f"{method} {path}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(503, UNREACHABLE, f"cannot reach the control plane at {self.url}: {reason}") from None
        if "json" in ctype:
            return json.loads(raw)
        return raw.decode()
