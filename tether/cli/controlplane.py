"""``tether controlplane serve``: a control plane wired from files and flags, served until a signal.

The server, its stores and aiohttp are imported when the command runs, never when the parser is built.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.capability.errors import USAGE, TetherError

from .process import listen_error, wait_for_signal

if TYPE_CHECKING:
    import ssl

    from tether.capability import keys
    from tether.capability.catalog import Catalog
    from tether.controlplane.app import ControlPlane
    from tether.controlplane.services.signin import SsoConfig


def add_controlplane_group(sub: Any) -> None:
    cp = sub.add_parser("controlplane", help="run the control plane").add_subparsers(
        dest="cp_command", required=True, metavar="ACTION")
    add_serve(cp)


def add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the control plane API (admin token: $TETHER_ADMIN_TOKEN)")
    p.add_argument("--store", default="sqlite:///tether.db", metavar="sqlite:///PATH|redis://HOST:PORT/DB",
                   help="where grants, runs, terminations and records live")
    p.add_argument("--listen", default="127.0.0.1:7000", metavar="H:P", help="the API's address")
    p.add_argument("--catalog", default=None, metavar="F",
                   help="the capability catalog (default ./catalog.yaml; without one, everything is absent)")
    p.add_argument("--signing-key", default="tether-signing.key", metavar="F",
                   help="the control plane's signing key (created, mode 0600, when missing)")
    p.add_argument("--lease-ttl", type=float, default=15.0, metavar="S",
                   help="seconds a sidecar may go without contact")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds past a drain window before reconciling")
    p.add_argument("--tls-cert", metavar="F.pem", default=None,
                   help="serve over TLS with this certificate (chain); the console's cookie is then __Host- and Secure")
    p.add_argument("--tls-key", metavar="F.pem", default=None, help="the private key of --tls-cert")
    p.add_argument("--rate-window", type=float, default=None, metavar="S",
                   help="length of the window a per_minute budget counts in (default 60, or TETHER_RATE_WINDOW_S; "
                        "shorter only for tests)")
    p.add_argument("--allow-self-approval", action="store_true",
                   help="let an operator approve calls of an agent whose chain they registered (default: refused, "
                        "separation of duties)")
    logs = p.add_argument_group("signed checkpoints of the record log (docs/termination.md)")
    logs.add_argument("--log-origin", default="tether/records", metavar="NAME",
                      help="the log's name in its checkpoints (give each deployment its own, e.g. tether.example.com/"
                           "records, before you give a witness its checkpoints)")
    logs.add_argument("--checkpoint-dir", metavar="DIR",
                      help="write every checkpoint here (checkpoint.SIZE, latest): an append-only or WORM mount")
    logs.add_argument("--checkpoint-sync", type=float, default=None, metavar="S",
                      help="write the directory's new checkpoint files and make them durable in one batch at most "
                           "every S seconds (default 5; 0: at every checkpoint) and at shutdown; a kill leaves them "
                           "in the journal .issued, a machine crash can lose the last S seconds of them, and the "
                           "next start writes them from the log (docs/audit.md)")
    logs.add_argument("--witness", action="append", default=[], metavar="URL",
                      help="send every checkpoint to this C2SP tlog-witness (tether witness serve); repeat")
    seal = p.add_argument_group("sealed segments: records of any size (docs/termination.md, \"Sealed segments\")")
    seal.add_argument("--seal-after", type=float, default=30.0, metavar="S",
                      help="seal a finished call into its link's chain of segments once it started this long ago "
                           "(default 30; 0 seals at once)")
    seal.add_argument("--seal-min", type=int, default=1000, metavar="N",
                      help="seal a chain only N calls at a time or more (default 1000; 0 turns sealing off)")
    sso = p.add_argument_group("single sign-on (OpenID Connect; docs/console.md)")
    sso.add_argument("--oidc-issuer", metavar="URL", help="the provider's issuer URL (turns single sign-on on)")
    sso.add_argument("--oidc-client-id", metavar="ID", help="the console's client at the provider")
    sso.add_argument("--oidc-client-secret-file", metavar="F",
                     help="the console client's secret, if it is a confidential client (else PKCE alone)")
    sso.add_argument("--oidc-cli-client-id", metavar="ID",
                     help="a native (public) client for `tether login` (a loopback redirect on any port)")
    sso.add_argument("--oidc-roles-claim", default="tether_roles", metavar="CLAIM",
                     help="the ID token claim listing the person's tether roles (default tether_roles)")
    sso.add_argument("--oidc-name-claim", default="preferred_username", metavar="CLAIM",
                     help="the claim that names the operator (default preferred_username; else the subject)")
    sso.add_argument("--oidc-redirect-uri", metavar="URL",
                     help="the console's callback as registered at the provider (default: this server's "
                          "/ui/oidc/callback as the browser reached it)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from tether.capability.shared import parse_listen

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = parse_listen(args.listen, 7000)
    tls = tls_context(args.tls_cert, args.tls_key)
    sso = sso_config(args)
    catalog = load_serving_catalog(args.catalog)  # bad input is refused before a token is made up and printed
    token, made_up = admin_token_from_env()
    cp = build(args.store, args.catalog, args.signing_key, token, lease_ttl_s=args.lease_ttl,
               grace_s=args.grace, rate_window_s=args.rate_window, tls=tls is not None, sso=sso,
               oidc_redirect_uri=args.oidc_redirect_uri, catalog=catalog)
    configure_checkpoints(cp, args)
    if args.seal_after < 0 or args.seal_min < 0:
        raise TetherError("--seal-after and --seal-min take a number of seconds and of calls, 0 or more", code=USAGE)
    cp.segments.settle_s, cp.segments.min_calls = args.seal_after, args.seal_min
    cp.approvals.separation_of_duties = not args.allow_self_approval
    # A made-up token is said once the server listens: never for a run that refused its input or its address.
    note = (f"tether: TETHER_ADMIN_TOKEN is not set; this run's admin token is\n    export TETHER_ADMIN_TOKEN={token}"
            if made_up else None)
    stopped_by = asyncio.run(serve(cp, host, port, tls=tls, announce=note))
    return 130 if stopped_by == signal.SIGINT else 0  # Ctrl-C: the shell's convention; SIGTERM: a clean stop


def load_serving_catalog(path: str | None) -> Catalog:
    """``--catalog``, or ./catalog.yaml when it exists, or an empty catalog (everything absent) with a warning."""
    from tether.capability.catalog import empty_catalog
    from tether.capability.shared import load_catalog

    if path is None:
        if not Path("catalog.yaml").exists():
            print("tether: no --catalog and no ./catalog.yaml: serving an empty catalog, so every capability "
                  "is absent and every call refused", file=sys.stderr)
            return empty_catalog()
        path = "catalog.yaml"
    return load_catalog(path)


def load_or_create_signing_key(path: str) -> keys.Ed25519PrivateKey:
    """The key at ``path``, or a new one written there. Creation is atomic and exclusive: replicas starting at
    the same moment on one directory end up sharing the first one's key (the others read it)."""
    from tether.capability import keys
    from tether.capability.shared import publish_file

    p = Path(path)
    if not p.exists():
        key = keys.generate()
        if publish_file(path, keys.private_pem(key)):
            publish_file(f"{path}.pub", keys.public_pem(key.public_key()), 0o644)
            print(f"tether: created signing key {path} (public half {path}.pub)", file=sys.stderr)
            return key
    return keys.load_private(p.read_bytes(), path)


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server's TLS context from ``--tls-cert``/``--tls-key`` (both or neither)."""
    import ssl

    from tether.capability.errors import BAD_REQUEST, TetherError

    if not cert and not key:
        return None
    if not cert or not key:
        raise TetherError("--tls-cert and --tls-key go together", code=BAD_REQUEST)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise TetherError(f"cannot load --tls-cert {cert} / --tls-key {key}: {exc}", code=BAD_REQUEST) from None
    return context


def admin_token_from_env() -> tuple[str, bool]:
    """``TETHER_ADMIN_TOKEN`` (warned about when short), or one made up for this run: (token, made up)."""
    from tether.controlplane.console.sessions import SignInThrottle

    token = os.environ.get("TETHER_ADMIN_TOKEN", "")
    if token:
        if len(token.strip()) < SignInThrottle.STRONG_CHARS:
            print(f"tether: TETHER_ADMIN_TOKEN is shorter than {SignInThrottle.STRONG_CHARS} characters: the console "
                  "treats it as guessable, so wrong tokens from one address hold it back too; use a longer one, or "
                  "sign in as a named operator (tether operators add)", file=sys.stderr)
        return token, False
    return secrets.token_urlsafe(24), True


def configure_checkpoints(cp: ControlPlane, args: argparse.Namespace) -> None:
    import re

    from tether.capability.errors import BAD_REQUEST, TetherError
    from tether.controlplane.services.checkpoints import Witness

    if not re.fullmatch(r"[^\s+]+", args.log_origin):
        raise TetherError(f"--log-origin {args.log_origin!r}: a name without spaces or '+'", code=BAD_REQUEST)
    cp.checkpoints.origin = args.log_origin
    cp.checkpoints.directory = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.checkpoint_sync is not None:
        if not args.checkpoint_sync >= 0:
            raise TetherError(f"--checkpoint-sync {args.checkpoint_sync}: seconds, 0 or more", code=BAD_REQUEST)
        cp.checkpoints.sync_s = args.checkpoint_sync
    cp.checkpoints.witnesses = [Witness(url) for url in args.witness]


def sso_config(args: argparse.Namespace) -> SsoConfig | None:
    """The ``--oidc-*`` options, checked (``tether.bad_request``), or None when single sign-on is off."""
    from tether.capability.errors import BAD_REQUEST, TetherError
    from tether.capability.shared import read_file
    from tether.controlplane.oidc import OidcSettings
    from tether.controlplane.services.signin import SsoConfig

    if not args.oidc_issuer:
        if args.oidc_client_id or args.oidc_cli_client_id:
            raise TetherError("--oidc-client-id needs --oidc-issuer", code=BAD_REQUEST)
        return None
    if not args.oidc_client_id:
        raise TetherError("--oidc-issuer needs --oidc-client-id (the console's client at the provider)",
                          code=BAD_REQUEST)
    secret = None
    if args.oidc_client_secret_file:
        secret = read_file(args.oidc_client_secret_file, "client secret").decode().strip()
    settings = OidcSettings(issuer=args.oidc_issuer, client_id=args.oidc_client_id, client_secret=secret,
                            roles_claim=args.oidc_roles_claim, name_claim=args.oidc_name_claim)
    return SsoConfig(settings, cli_client_id=args.oidc_cli_client_id)


def build(store_url: str, catalog_path: str | None, signing_key_path: str, admin_token: str,
          rate_window_s: float | None = None, tls: bool = False, sso: SsoConfig | None = None,
          oidc_redirect_uri: str | None = None, catalog: Catalog | None = None, **options: float) -> ControlPlane:
    """``catalog``: already loaded from ``catalog_path`` (else it is loaded here)."""
    from tether.controlplane import console
    from tether.controlplane.app import ControlPlane
    from tether.controlplane.store import open_store_url

    if catalog is None:
        catalog = load_serving_catalog(catalog_path)  # before any file is created: bad input leaves nothing behind
    store = open_store_url(store_url)
    cp = ControlPlane(store, load_or_create_signing_key(signing_key_path), catalog, admin_token,
                      budget_window_s=rate_window_s, signing_key_source=signing_key_path, **options)
    ui = console.install(cp, tls=tls)  # the web console at /ui/
    if sso is not None:
        from tether.controlplane.console import sso as sso_routes
        from tether.controlplane.services.signin import SingleSignOn

        sso_routes.install(cp, ui, SingleSignOn(sso, cp.operators, store, cp.signing_key, cp.clock),
                           oidc_redirect_uri)
        print(f"tether: single sign-on through {sso.settings.issuer} (console client {sso.settings.client_id}"
              f"{', CLI client ' + sso.cli_client_id if sso.cli_client_id else ''})", file=sys.stderr)
    return cp


async def serve(cp: ControlPlane, host: str, port: int, ready: asyncio.Event | None = None,
                tls: ssl.SSLContext | None = None, announce: str | None = None) -> int:
    """Serve until SIGTERM or SIGINT (over TLS with ``tls``); returns the signal that stopped it. ``announce`` is
    printed once it listens."""
    from aiohttp import web

    runner = web.AppRunner(cp.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise listen_error(f"the control plane cannot listen on {host}:{port}", exc) from None
    print(
        f"tether: control plane {cp.replica} listening on {'https' if tls else 'http'}://{host}:{port} (store "
        f"{cp.store.url}, catalog {cp.catalog.hash[:19]}…)",
        file=sys.stderr,
        flush=True,
    )
    if announce:
        print(announce, file=sys.stderr, flush=True)
    if tls is None:
        print(f"tether: the console (/ui/) is served over plain HTTP: browsers send its session cookie to every port "
              f"of {host} (cookies are scoped by host, not port), so any process listening on one can read a "
              "session; serve it with --tls-cert/--tls-key", file=sys.stderr, flush=True)
    try:
        return await wait_for_signal(ready.set if ready is not None else None)
    finally:
        await runner.cleanup()
