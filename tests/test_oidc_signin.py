"""Single sign-on end to end: a control plane configured with a real OpenID provider (panva's oidc-provider), a
person signing in to the console in Chromium and to the CLI with `tether login`, acting with the roles the
provider's claim gives, attributed `via: oidc`, and stopped by `tether operators revoke`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from .harness import ADMIN_TOKEN, PYTHON, ControlPlaneProcess, prepare_controlplane, wait_until
from .oidc_provider import OidcProvider, sign_in
from .test_console import browser  # noqa: F401  (the Chromium fixture)

ACCOUNTS = {"alice": ["approver"], "rita": ["responder"], "nobody": []}


@pytest.fixture(scope="module")
def sso(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlaneProcess, OidcProvider]]:
    directory = tmp_path_factory.mktemp("sso")
    cp = prepare_controlplane(directory / "cp", 1, 2, 3)
    provider = OidcProvider(directory, f"{cp.url}/ui/oidc/callback", ACCOUNTS).start()
    cp.options = ("--oidc-issuer", provider.issuer, "--oidc-client-id", "tether-console",
                  "--oidc-cli-client-id", "tether-cli")
    try:
        cp.start()
        try:
            yield cp, provider
        finally:
            cp.stop()
    finally:
        provider.stop()


def tether(cp: ControlPlaneProcess, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in cp.env().items() if k != "TETHER_ADMIN_TOKEN"}
    if token:
        env["TETHER_TOKEN"] = token
    return subprocess.run([PYTHON, "-m", "tether", *args], env=env, capture_output=True, text=True, timeout=60)


def cli_login(cp: ControlPlaneProcess, login: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`tether login --no-browser`, with a person completing the sign-in at the URL it prints."""
    env = {k: v for k, v in cp.env().items() if k != "TETHER_ADMIN_TOKEN"}
    proc = subprocess.Popen([PYTHON, "-m", "tether", "login", "--no-browser", "--wait", "60"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    url = ""
    while not url:
        line = proc.stderr.readline()
        assert line, f"tether login ended early: {proc.wait()}"
        url = line.strip() if line.strip().startswith("http") else ""
    redirect = parse_qs(urlsplit(url).query)["redirect_uri"][0]
    assert redirect.startswith("http://127.0.0.1:") and redirect.endswith("/callback")
    back = sign_in(url, login, redirect)
    httpx.get(redirect, params=back, timeout=15)  # the browser's last hop: to the CLI's loopback listener
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), url


def test_tether_login_gives_a_short_lived_operator_token_with_the_providers_roles(
        sso: tuple[ControlPlaneProcess, OidcProvider]) -> None:
    cp, provider = sso
    done, url = cli_login(cp, "rita")
    assert "code_challenge_method=S256" in url and url.startswith(provider.issuer)
    assert done.returncode == 0, done.stderr
    assert "signed in as rita (responder) via oidc" in done.stderr
    assert done.stdout.startswith("export TETHER_TOKEN=")
    token = done.stdout.strip().split("=", 1)[1]

    me = tether(cp, "operators", "whoami", "--json", token=token)
    assert me.returncode == 0, me.stderr
    assert json.loads(me.stdout) == {"operator": "rita", "via": "oidc", "roles": ["responder"]}
    refused = tether(cp, "operators", "add", "eve", "--role", "admin", token=token)  # an admin's action
    assert refused.returncode == 2 and "tether.forbidden" in refused.stderr and "admin" in refused.stderr
    assert tether(cp, "records", "list", token=token).returncode == 0  # every role reads

    revoked = tether(cp, "operators", "revoke", "rita", token=ADMIN_TOKEN)
    assert revoked.returncode == 0, revoked.stderr
    after = tether(cp, "operators", "whoami", token=token)
    assert after.returncode == 2 and "tether.forbidden" in after.stderr


def test_an_id_token_is_exchanged_once_and_only_the_clis(sso: tuple[ControlPlaneProcess, OidcProvider]) -> None:
    import asyncio

    from tether.controlplane.oidc import OidcClient, OidcSettings

    cp, provider = sso

    async def id_token_for(client_id: str, redirect: str) -> str:
        client = OidcClient(OidcSettings(issuer=provider.issuer, client_id=client_id))
        url, pending = await client.begin(redirect)
        back = await asyncio.to_thread(sign_in, url, "alice", redirect)
        token, _ = await client.redeem(pending, code=back["code"], state=back["state"])
        return token

    cli_token = asyncio.run(id_token_for("tether-cli", "http://127.0.0.1:9/callback"))
    first = httpx.post(cp.url + "/v1/auth/oidc/token", json={"id_token": cli_token}, timeout=15)
    assert first.status_code == 200 and first.json()["operator"] == "alice"
    again = httpx.post(cp.url + "/v1/auth/oidc/token", json={"id_token": cli_token}, timeout=15)
    assert again.status_code == 401 and "exchanged already" in again.json()["error"]["message"]

    console_token = asyncio.run(id_token_for("tether-console", f"{cp.url}/ui/oidc/callback"))
    other = httpx.post(cp.url + "/v1/auth/oidc/token", json={"id_token": console_token}, timeout=15)
    assert other.status_code == 401  # its audience is the console's client: a token taken from a browser is useless

    garbage = httpx.post(cp.url + "/v1/auth/oidc/token", json={"id_token": "a.b.c"}, timeout=15)
    assert garbage.status_code == 401


def test_a_person_without_a_tether_role_is_refused(sso: tuple[ControlPlaneProcess, OidcProvider]) -> None:
    cp, _ = sso
    done, _ = cli_login(cp, "nobody")
    assert done.returncode == 2 and "tether.forbidden" in done.stderr and "tether_roles" in done.stderr
    assert not done.stdout


def test_the_console_signs_in_through_the_provider_in_chromium(
        sso: tuple[ControlPlaneProcess, OidcProvider], browser: Any) -> None:  # noqa: F811
    cp, provider = sso
    page = browser.new_context().new_page()
    page.goto(f"{cp.url}/ui/")
    link = page.get_by_role("link", name="Sign in with single sign-on")
    link.wait_for()
    assert f"127.0.0.1:{provider.port}" in link.inner_text()
    link.click()
    page.wait_for_url(f"{provider.issuer}/interaction/**")
    page.fill("input[name=login]", "alice")
    page.fill("input[name=password]", "anything")
    page.click("button[type=submit]")
    page.get_by_role("button", name="Continue").click()  # the provider's consent page
    page.wait_for_url(f"{cp.url}/ui/")
    wait_until(lambda: page.locator("#whoami").inner_text() == "alice (approver)", 30, what="signed in as alice")
    session = page.evaluate("fetch('/v1/operators/me').then(r => r.json())")
    assert session == {"operator": "alice", "via": "oidc", "roles": ["approver"]}


def test_a_callback_without_the_browsers_pending_sign_in_is_refused(
        sso: tuple[ControlPlaneProcess, OidcProvider], tmp_path: Path) -> None:
    cp, _ = sso
    with httpx.Client(timeout=15) as victim, httpx.Client(timeout=15) as attacker:
        start = attacker.get(cp.url + "/ui/oidc/login")
        assert start.status_code == 303 and "tether_oidc" in start.headers["set-cookie"]
        back = sign_in(start.headers["location"], "alice", cp.url + "/ui/oidc/callback", http=attacker)
        # Login CSRF: the attacker's code and state, in the victim's browser (which began no sign-in).
        forced = victim.get(cp.url + "/ui/oidc/callback", params=back)
        assert forced.status_code == 401 and "tether_session" not in forced.headers.get("set-cookie", "")
        done = attacker.get(cp.url + "/ui/oidc/callback", params=back)
        assert done.status_code == 303 and done.headers["location"] == "/ui/"
        assert attacker.get(cp.url + "/v1/operators/me").json()["operator"] == "alice"
