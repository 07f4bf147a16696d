"""Sign-in through a real OpenID Connect provider (panva's oidc-provider): the authorization-code flow with
PKCE, the ID token checked against the provider's keys, and the roles claim read into an operator."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tether.capability.errors import TetherError
from tether.controlplane.oidc import OidcClient, OidcSettings, operator_from, roles_from

from .oidc_provider import OidcProvider, sign_in

CALLBACK = "http://127.0.0.1:7999/ui/oidc/callback"
ACCOUNTS = {"alice": ["approver", "viewer"], "bob": ["responder"], "mallory": ["root", "superuser"]}


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    p = OidcProvider(tmp_path_factory.mktemp("oidc"), CALLBACK, ACCOUNTS).start()
    try:
        yield p
    finally:
        p.stop()


def settings(provider: OidcProvider, **changes: str) -> OidcSettings:
    return replace(OidcSettings(issuer=provider.issuer, client_id="tether-console"), **changes)


def test_a_person_signs_in_and_becomes_an_operator_with_the_roles_of_the_claim(provider: OidcProvider) -> None:
    client = OidcClient(settings(provider))

    async def flow() -> object:
        url, pending = await client.begin(CALLBACK)
        assert "code_challenge_method=S256" in url and f"state={pending.state}" in url
        back = await asyncio.to_thread(sign_in, url, "alice", CALLBACK)
        assert back["iss"] == provider.issuer
        return await client.finish(pending, code=back["code"], state=back["state"], iss=back["iss"])

    who = asyncio.run(flow())
    assert who.name == "alice" and who.via == "oidc" and who.issuer == provider.issuer
    assert who.roles == ("viewer", "approver")  # in tether's order, whatever the claim's


def test_a_callback_that_does_not_match_the_sign_in_is_refused(provider: OidcProvider) -> None:
    client = OidcClient(settings(provider))

    async def flow() -> list[str]:
        refusals = []
        url, pending = await client.begin(CALLBACK)
        back = await asyncio.to_thread(sign_in, url, "bob", CALLBACK)
        for kwargs in ({"code": back["code"], "state": "forged"},                      # CSRF: another state
                       {"code": back["code"], "state": back["state"], "iss": "http://127.0.0.1:1"},  # mix-up
                       {"code": None, "state": back["state"]}):                         # no code
            with pytest.raises(TetherError) as refused:
                await client.finish(pending, **kwargs)
            refusals.append(refused.value.code)
        who = await client.finish(pending, code=back["code"], state=back["state"])
        assert who.name == "bob" and who.roles == ("responder",)
        with pytest.raises(TetherError) as replayed:  # a code is redeemed once
            await client.finish(pending, code=back["code"], state=back["state"])
        refusals.append(replayed.value.code)
        # The same code with another sign-in's verifier (PKCE): an intercepted code is useless.
        url2, pending2 = await client.begin(CALLBACK)
        back2 = await asyncio.to_thread(sign_in, url2, "bob", CALLBACK)
        stolen = replace(pending2, code_verifier=pending.code_verifier)
        with pytest.raises(TetherError) as pkce:
            await client.finish(stolen, code=back2["code"], state=back2["state"])
        refusals.append(pkce.value.code)
        return refusals

    assert asyncio.run(flow()) == ["tether.unauthorized"] * 5


def test_a_sign_in_without_a_tether_role_is_refused_not_let_in_as_a_viewer(provider: OidcProvider) -> None:
    client = OidcClient(settings(provider))

    async def flow() -> None:
        url, pending = await client.begin(CALLBACK)
        back = await asyncio.to_thread(sign_in, url, "mallory", CALLBACK)
        await client.finish(pending, code=back["code"], state=back["state"])

    with pytest.raises(TetherError) as refused:
        asyncio.run(flow())
    assert refused.value.code == "tether.forbidden" and "tether_roles" in refused.value.message


def test_an_id_token_for_another_client_or_issuer_is_refused(provider: OidcProvider) -> None:
    console = OidcClient(settings(provider))

    async def flow() -> None:
        url, pending = await console.begin(CALLBACK)
        back = await asyncio.to_thread(sign_in, url, "alice", CALLBACK)
        token, _ = await console.redeem(pending, code=back["code"], state=back["state"])
        cli = OidcClient(settings(provider, client_id="tether-cli"))
        with pytest.raises(TetherError, match="does not verify"):  # its audience is the console, not the CLI
            await cli.verify_id_token(token, pending.nonce)
        with pytest.raises(TetherError, match="nonce"):
            await console.verify_id_token(token, "another-sign-in")
        assert (await console.verify_id_token(token, pending.nonce))["sub"] == "alice"
        forged = token.rsplit(".", 1)[0] + "." + "A" * 86
        with pytest.raises(TetherError, match="does not verify"):
            await console.verify_id_token(forged, pending.nonce)

    asyncio.run(flow())


def test_a_discovery_document_naming_another_issuer_is_refused(provider: OidcProvider, tmp_path: Path) -> None:
    lying = OidcClient(OidcSettings(issuer=provider.issuer + "/", client_id="tether-console"))
    with pytest.raises(TetherError, match="calls itself"):
        asyncio.run(lying.metadata())


def test_roles_come_from_a_list_or_a_string_and_unknown_names_are_dropped() -> None:
    assert roles_from(["admin", "root"]) == ("admin",)
    assert roles_from("approver, viewer") == ("viewer", "approver")
    assert roles_from({"admin": True}) == () and roles_from(None) == ()
    s = OidcSettings(issuer="https://id.example", client_id="c", name_claim="email")
    who = operator_from({"sub": "123", "email": "ops@example.com", "tether_roles": ["responder"]}, s)
    assert (who.name, who.roles, who.subject) == ("ops@example.com", ("responder",), "123")
    assert operator_from({"sub": "123", "tether_roles": "viewer"}, s).name == "123"  # no name claim: the subject
    with pytest.raises(TetherError):
        operator_from({"email": "x", "tether_roles": "viewer"}, s)
