"""The CLI's synchronous transport to the control plane API (standard library only).

What a request and its answer mean is the client core's (``tether/capability/transport.py``), shared with the
sidecar's async transport; this module only moves the bytes with ``urllib``. It does not retry: a command
reports a failure and lets the person decide (``tether terminate --wait`` polls on its own).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Any

from tether.capability import transport
from tether.capability.errors import CONTROLPLANE_UNREACHABLE
from tether.capability.transport import Signer

__all__ = ["DEFAULT_URL", "UNREACHABLE", "Client", "Signer"]

DEFAULT_URL = "http://127.0.0.1:7000"
UNREACHABLE = CONTROLPLANE_UNREACHABLE


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
        prepared = transport.prepare(self.url, method, path, body, signer=signer,
                                     bearer=self.admin_token if admin else None)
        req = urllib.request.Request(prepared.url, data=prepared.body if method != "GET" else None, method=method,
                                     headers=prepared.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type")
        except urllib.error.HTTPError as exc:
            status, raw, ctype = exc.code, exc.read(), exc.headers.get("Content-Type") if exc.headers else None
        except (urllib.error.URLError, OSError) as exc:
            raise transport.unreachable(self.url, str(getattr(exc, "reason", exc))) from None
        return transport.read_answer(status, raw, ctype, f"{method} {self.url}{path}", text_ok=True)
