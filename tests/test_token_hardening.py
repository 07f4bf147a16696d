"""Tokens from an outside corpus (issue 11): agent ids outside the format in any claim that names an agent,
private keys inside a grant, links dated in the future, jtis that are not URL-safe, and refusals that must
print whatever the input held. Links are forged and signed with real keys, so only the rule under test fails.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tether.capability import keys
from tether.capability.chain import LEEWAY_S, Verifier, parse_link
from tether.capability.errors import ChainExpired, ChainInvalid, escape_unprintable

from .harness import PYTHON, prepare_controlplane
from .test_chain import CP, NOW, T0, Node, forge, forge_child, forge_root, root_claims, wire

BAD_IDS = {
    "slash": "a/b",
    "comma": "a,b",
    "space": "a b",
    "newline": "a\nb",
    "ansi escape": "\x1b[31mred\x1b[0m",
    "too long": "x" * 129,
    "lone surrogate": "agent-\ud800",
    "non-ascii letter": "caf\u00e9",
    "percent": "a%2fb",
    "bidi override": "a\u202eb",
    "question mark": "a?b",
}


@pytest.mark.parametrize("bad", list(BAD_IDS.values()), ids=list(BAD_IDS))
@pytest.mark.parametrize("where", ["root sub", "child sub", "child iss"])
def test_an_agent_id_outside_the_format_is_refused_wherever_a_link_names_one(where: str, bad: str) -> None:
    root = forge_root()
    if where == "root sub":
        compact = forge_root(sub=bad).compact
        index, chain = 0, compact
    else:
        node = forge_child(root, **({"sub": bad} if where == "child sub" else {"iss": bad}))
        compact, index, chain = node.compact, 1, wire(root, node)
    with pytest.raises(ChainInvalid) as info:
        parse_link(compact, index)
    assert info.value.reason == "bad_agent_id", info.value
    with pytest.raises(ChainInvalid) as info:
        Verifier(CP.public_key()).verify(chain, now=NOW)
    assert info.value.reason == "bad_agent_id"
    message = str(info.value)
    assert message.isprintable() and message.isascii(), message  # nothing raw reaches a terminal or log
    message.encode("utf-8")  # a lone surrogate would raise here (and in print)


@pytest.mark.parametrize("good", ["a", "agent-a", "team.alpha:worker_1", "A" * 128, "tether:controlplane"])
def test_ids_in_the_format_pass(good: str) -> None:
    assert parse_link(forge_root(sub=good).compact).sub == good


def test_a_grant_that_carries_its_private_key_is_refused() -> None:
    subject = keys.generate()
    jwk = {**keys.to_jwk(subject.public_key()), "d": keys.b64url(subject.private_bytes_raw())}
    node = Node(forge(root_claims(subject, cnf={"jwk": jwk}), CP), subject)
    with pytest.raises(ChainInvalid) as info:
        parse_link(node.compact)
    assert info.value.reason == "private_key_in_grant"
    child = forge_child(forge_root(), cnf={"jwk": {**keys.to_jwk(subject.public_key()), "d": "AAAA"}})
    with pytest.raises(ChainInvalid) as info:
        parse_link(child.compact, 1)
    assert info.value.reason == "private_key_in_grant"


@pytest.mark.parametrize("link", ["root", "child"])
def test_a_link_issued_in_the_future_beyond_the_leeway_is_refused(link: str) -> None:
    future = NOW + LEEWAY_S + 60
    root = forge_root(iat=future) if link == "root" else forge_root()
    chain = wire(root) if link == "root" else wire(root, forge_child(root, iat=future))
    with pytest.raises(ChainExpired) as info:
        Verifier(CP.public_key()).verify(chain, now=NOW)
    assert info.value.reason == "issued_in_future"
    # within the leeway, and once the clock has caught up, the same chain verifies
    Verifier(CP.public_key()).verify(chain, now=future - LEEWAY_S)
    near = forge_root(iat=NOW + LEEWAY_S - 1)
    Verifier(CP.public_key()).verify(wire(near), now=NOW)


@pytest.mark.parametrize("jti", ["a/" + "b" * 20, "a" * 20 + "\x1b[0m", "a" * 20 + " ", "a" * 20 + "?x=1"])
def test_a_jti_that_is_not_url_safe_is_refused(jti: str) -> None:
    with pytest.raises(ChainInvalid) as info:
        parse_link(forge_root(jti=jti).compact)
    assert info.value.reason == "malformed" and "jti" in str(info.value)


def test_messages_escape_what_no_terminal_should_get() -> None:
    assert escape_unprintable("plain text") == "plain text"
    assert escape_unprintable("a\x1b[31mb\ud800c\u202ed") == "a\\x1b[31mb\\ud800c\\u202ed"
    assert escape_unprintable("line\nnext") == "line\nnext"  # other errors keep their line breaks ...
    err = ChainInvalid("widened_capability", "x\ny\x1b")
    assert err.message == "x\\ny\\x1b"  # ... a chain refusal is one line


def test_grant_verify_prints_a_refusal_of_any_input_and_says_when_no_revocation_list_was_read(
        tmp_path: Path) -> None:
    trust = tmp_path / "cp.pub"
    trust.write_bytes(keys.public_pem(CP.public_key()))

    def verify(chain: str, *extra: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "chain"
        path.write_text(chain, encoding="utf-8", errors="surrogatepass")
        return subprocess.run([PYTHON, "-m", "tether", "grant", "verify", "--chain", str(path),
                               "--trust", str(trust), *extra], capture_output=True, text=True, timeout=60,
                              errors="surrogateescape")

    for bad in BAD_IDS.values():
        out = verify(forge_root(sub=bad, exp=T0 + 10**8).compact)
        assert out.returncode == 1, (bad, out.stdout, out.stderr)
        assert "tether.chain_invalid (bad_agent_id)" in out.stdout and "Traceback" not in out.stderr, out
        assert "\x1b" not in out.stdout + out.stderr
    good = forge_root(iat=T0, nbf=T0, exp=T0 + 10**8).compact
    out = verify(good)
    assert out.returncode == 0 and "no revocation list was consulted" in out.stdout, out
    out = verify(good, "--revoked", "f" * 32)
    assert out.returncode == 0 and "no revocation list" not in out.stdout, out


def test_terminate_and_revoke_name_an_odd_id_as_one_path_segment(tmp_path: Path) -> None:
    """An id with '/', '?', '#' or a space reaches the control plane as that id (a clean 'not found'), never
    as another route or a client that cannot build its URL."""
    cp = prepare_controlplane(tmp_path / "cp", 1, 2, 3).start()
    try:
        for odd in ("a/b", "a b", "x?y=1", "x#y", "..", "a%2Fb"):
            for args in (["terminate", odd, "--mode", "drain"], ["revoke", "--agent", odd],
                         ["revoke", odd]):
                out = subprocess.run([PYTHON, "-m", "tether", *args], env=cp.env(), capture_output=True,
                                     text=True, timeout=60)
                assert out.returncode != 0, (args, out.stdout)
                # A jti is hex: an odd one is refused before anything is sent; an agent id reaches the control
                # plane as that one id.
                code = "tether.bad_request" if args == ["revoke", odd] else "tether.not_found"
                assert f"error: {code}" in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    finally:
        cp.stop()
