"""``tether login``: sign in through the control plane's OpenID Connect provider and get an operator token.

A native app's flow (RFC 8252): a one-shot listener on a loopback port receives the provider's redirect; the
authorization code is redeemed with its PKCE verifier; the ID token is handed to the control plane, which
checks it again and answers with a short-lived operator token. The token goes to stdout as an ``export`` line
(``eval "$(tether login)"``); everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .remote import add_controlplane, client

WAIT_S = 600.0
DONE_PAGE = (b"<!doctype html><meta charset=utf-8><title>tether</title>"
             b"<p>Signed in. You can close this tab and go back to the terminal.</p>")


def add_login(sub: Any) -> None:
    p = sub.add_parser("login", help="sign in through the control plane's OpenID Connect provider; prints "
                                     "`export TETHER_TOKEN=...` (use: eval \"$(tether login)\")")
    add_controlplane(p)
    p.add_argument("--no-browser", action="store_true", help="print the sign-in URL only; do not open a browser")
    p.add_argument("--wait", type=float, default=WAIT_S, metavar="S", help="how long to wait for the sign-in")
    p.set_defaults(func=cmd_login)


class _Callback:
    """The one redirect the provider sends back to the loopback listener."""

    def __init__(self) -> None:
        self.query: dict[str, str] | None = None
        self.arrived = threading.Event()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        box = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                if parts.path != "/callback" or box.arrived.is_set():
                    self.send_error(404)
                    return
                box.query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(DONE_PAGE)))
                self.end_headers()
                self.wfile.write(DONE_PAGE)
                box.arrived.set()

            def log_message(self, *_: Any) -> None:
                pass

        return Handler


def cmd_login(args: argparse.Namespace) -> int:
    from tether.capability.errors import UNAUTHORIZED, TetherError
    from tether.controlplane.oidc import OidcClient, OidcSettings

    c = client(args)
    config = c.request("GET", "/v1/auth/oidc", admin=False)
    settings = OidcSettings(issuer=config["issuer"], client_id=config["cli_client_id"], scope=config["scope"])
    oidc = OidcClient(settings)
    callback = _Callback()
    server = HTTPServer(("127.0.0.1", 0), callback.handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        redirect = f"http://127.0.0.1:{server.server_address[1]}/callback"
        url, pending = asyncio.run(oidc.begin(redirect))
        print(f"tether: sign in at\n    {url}", file=sys.stderr, flush=True)
        if not args.no_browser:
            webbrowser.open(url)
        if not callback.arrived.wait(args.wait):
            raise TetherError(f"no sign-in within {args.wait:.0f} s", code=UNAUTHORIZED)
    finally:
        server.shutdown()
        server.server_close()
    query = callback.query or {}
    if "error" in query:
        raise TetherError(f"the provider refused the sign-in: {query['error']} {query.get('error_description', '')}",
                          code=UNAUTHORIZED)
    id_token, _ = asyncio.run(oidc.redeem(pending, code=query.get("code"), state=query.get("state"),
                                          iss=query.get("iss")))
    issued = c.request("POST", "/v1/auth/oidc/token", {"id_token": id_token}, admin=False)
    print(f"tether: signed in as {issued['operator']} ({', '.join(issued['roles'])}) via oidc; the token expires "
          f"in {issued['expires_in_s'] / 3600:.1f} h", file=sys.stderr)
    print(f"export TETHER_TOKEN={shlex.quote(issued['token'])}")
    return 0
