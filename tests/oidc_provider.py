"""A real OpenID Connect provider for tests: panva's ``oidc-provider`` from npm (pinned by
``tests/oidc/package-lock.json``), run with the machine's Node, and a person signing in through its
development pages (a login form that takes any password, then a consent form), driven over HTTP.

The npm packages are installed once per machine into ``$TETHER_OIDC_CACHE`` (else the repo's ignored
``.cache/oidc``), as the conformance kit is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx

from .harness import free_port, stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
KIT = Path(__file__).resolve().parent / "oidc"
KIT_FILES = ("package.json", "package-lock.json", "provider.mjs")
CACHE_ENV = "TETHER_OIDC_CACHE"


class KitUnavailable(RuntimeError):
    """npm could not install the provider here."""


def install(timeout: float = 180) -> Path:
    configured = os.environ.get(CACHE_ENV)
    root = (Path(configured).expanduser() if configured else REPO / ".cache" / "oidc").resolve()
    root.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(b"".join((KIT / n).read_bytes() for n in KIT_FILES)).hexdigest()
    stamp = root / "kit.sha256"
    npm = shutil.which("npm")
    if npm is None:
        raise KitUnavailable("npm is not on PATH")
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        installed = (root / "node_modules" / "oidc-provider").exists()
        if installed and stamp.exists() and stamp.read_text().strip() == digest:
            return root
        for name in KIT_FILES:
            shutil.copyfile(KIT / name, root / name)
        try:
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefer-offline", "--loglevel=error",
                                   "--fetch-timeout=60000"], cwd=root, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KitUnavailable(f"npm ci in {root} did not finish within {timeout:.0f} s") from None
        if done.returncode != 0:
            raise KitUnavailable(f"npm ci in {root} failed: {(done.stderr or done.stdout)[-800:]}")
        stamp.write_text(digest + "\n")
    return root


@dataclass
class OidcProvider:
    """``oidc-provider`` on a free loopback port. ``accounts``: login -> the roles claim it gets."""

    directory: Path
    console_redirect: str
    accounts: dict[str, list[str]]
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OidcProvider:
        root = install()
        self.port = self.port or free_port()
        log = open(self.directory / "oidc-provider.log", "ab")
        self.proc = subprocess.Popen(
            ["node", str(root / "provider.mjs"), str(self.port), self.console_redirect, json.dumps(self.accounts)],
            cwd=root, stdout=log, stderr=log)
        wait_until(self._answers, 30, what=f"oidc-provider on {self.port} (log {self.directory}/oidc-provider.log)")
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError((self.directory / "oidc-provider.log").read_text()[-2000:])
        try:
            return httpx.get(self.issuer + "/.well-known/openid-configuration", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


_FORM = re.compile(r'<form[^>]*action="(?P<action>[^"]+)"', re.I)
_HIDDEN = re.compile(r'<input type="hidden" name="(?P<name>[^"]+)" value="(?P<value>[^"]*)"', re.I)


def sign_in(authorize_url: str, login: str, redirect_prefix: str, http: httpx.Client | None = None) -> dict[str, str]:
    """Walk the provider's development pages as a person would (log in as ``login``, consent) and return the
    query of the redirect back to ``redirect_prefix`` (``code``, ``state``, ``iss``), without following it."""
    own = http is None
    http = http or httpx.Client(timeout=15)
    try:
        url = authorize_url
        for _ in range(12):
            if url.startswith(redirect_prefix):
                return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
            resp = http.get(url)
            if resp.status_code in (302, 303):
                url = urljoin(url, resp.headers["location"])
                continue
            form = _FORM.search(resp.text)
            if resp.status_code != 200 or form is None:
                raise AssertionError(f"the provider answered {resp.status_code} at {url}: {resp.text[:500]}")
            action = urljoin(url, form.group("action"))
            fields = {m.group("name"): m.group("value") for m in _HIDDEN.finditer(resp.text)}
            if 'name="login"' in resp.text:
                fields |= {"login": login, "password": "any"}
            posted = http.post(action, data=fields)
            assert posted.status_code in (302, 303), (posted.status_code, posted.text[:500])
            url = urljoin(action, posted.headers["location"])
        raise AssertionError(f"no redirect to {redirect_prefix} after 12 steps (last {url})")
    finally:
        if own:
            http.close()
