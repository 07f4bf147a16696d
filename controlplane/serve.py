"""Wiring a control plane from files and flags, and serving it (``tether controlplane serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

from aiohttp import web

from capability import keys
from capability.catalog import Catalog, empty_catalog
from capability.shared import load_catalog

from .app import ControlPlane
from .store import open_store_url

log = logging.getLogger("tether.controlplane")



def load_serving_catalog(path: str | None) -> Catalog:
    """``--catalog``, or ./catalog.yaml when it exists, or an empty catalog (everything absent) with a warning."""
    if path is None:
        if not Path("catalog.yaml").exists():
            print("tether: no --catalog and no ./catalog.yaml: serving an empty catalog, so every capability "
                  "is absent and every call refused", file=sys.stderr)
            return empty_catalog()
        path = "catalog.yaml"
    return load_catalog(path)



def load_or_create_signing_key(path: str) -> keys.Ed25519PrivateKey:
    p = Path(path)
    if p.exists():
        return keys.load_private(p.read_bytes(), path)
    key = keys.generate()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(keys.private_pem(key))
    Path(f"{path}.pub").write_bytes(keys.public_pem(key.public_key()))
    print(f"tether: created signing key {path} (public half {path}.pub)", file=sys.stderr)
    return key


def admin_token_from_env() -> str:
    token = os.environ.get("TETHER_ADMIN_TOKEN", "")
    if token:
        return token
    token = secrets.token_urlsafe(24)
    print(
        f"tether: TETHER_ADMIN_TOKEN is not set; this run's admin token is\n    export TETHER_ADMIN_TOKEN={token}",
        file=sys.stderr,
    )
    return token


def build(store_url: str, catalog_path: str | None, signing_key_path: str, admin_token: str,
          rate_window_s: float | None = None, **options: float) -> ControlPlane:
    from . import budgets, console

    catalog = load_serving_catalog(catalog_path)  # before any file is created: bad input leaves nothing behind
    store = open_store_url(store_url)
    cp = ControlPlane(store, load_or_create_signing_key(signing_key_path), catalog, admin_token, **options)
    budgets.install(cp, rate_window_s)  # slices of call budgets, /v1/budgets
    console.install(cp)  # the web console at /ui/
    return cp


async def serve(cp: ControlPlane, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    runner = web.AppRunner(cp.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(
        f"tether: control plane {cp.replica} listening on http://{host}:{port} (store {cp.store.url}, "
        f"catalog {cp.catalog.hash[:19]}…)",
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
