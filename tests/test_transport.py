"""The client core (tether/capability/transport.py), pure: both transports' requests and answers mean the same."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.capability import keys, transport
from tether.capability.errors import CONTROLPLANE_UNREACHABLE, ApiError
from tether.capability.proof import check_proof, read_proof

KEY = keys.generate()
SIGNER = transport.Signer("agent-a", "sha256:link", KEY, run="run-1")


def test_a_signed_request_carries_a_proof_over_the_body_the_control_plane_reads() -> None:
    big = {"reports": [{"call_id": str(i), "url": "http://127.0.0.1/x"} for i in range(2000)]}
    request = transport.prepare("http://cp:7000/", "POST", "/v1/reports", big, signer=SIGNER, compress_above=1024,
                                now=lambda: 1000.0)
    assert request.url == "http://cp:7000/v1/reports" and request.headers["Content-Encoding"] == "gzip"
    plain = gzip.decompress(request.body)
    assert json.loads(plain) == big
    proof = read_proof(request.headers["Tether-Proof"])
    check_proof(proof, KEY.public_key(), method="POST", path="/v1/reports", body=plain, now=1000.0)
    assert (proof.agent, proof.link, proof.run) == ("agent-a", "sha256:link", "run-1")
    assert "Authorization" not in request.headers


def test_an_unsigned_request_carries_the_operators_token_and_small_bodies_go_as_they_are() -> None:
    request = transport.prepare("http://cp", "GET", "/v1/agents", bearer="tok")
    assert (request.body, request.headers["Authorization"]) == (b"", "Bearer tok")
    assert "Tether-Proof" not in request.headers and "Content-Encoding" not in request.headers
    assert transport.prepare("http://cp", "POST", "/x", encoded=b'{"a":1}').body == b'{"a":1}'


def test_a_refusal_keeps_the_control_planes_code_message_and_details() -> None:
    raw = json.dumps({"error": {"code": "tether.bad_request", "message": "no", "field": "chain"}}).encode()
    with pytest.raises(ApiError) as refused:
        transport.read_answer(400, raw, "application/json", "POST /x")
    assert (refused.value.http_status, refused.value.code, refused.value.message) == (400, "tether.bad_request", "no")
    assert refused.value.details["field"] == "chain"


@given(st.integers(400, 599), st.one_of(st.binary(max_size=40), st.just(b'{"error": "flat"}'), st.just(b"[1]")))
def test_an_answer_no_control_plane_gave_says_so_and_never_passes_for_a_tether_code(status: int, raw: bytes) -> None:
    with pytest.raises(ApiError) as refused:
        transport.read_answer(status, raw, None, "GET http://cp/x")
    assert refused.value.code == transport.HTTP_ERROR and "is the URL right?" in refused.value.message


def test_answers_read_as_json_text_or_nothing() -> None:
    assert transport.read_answer(200, b'{"a": 1}', "application/json", "x") == {"a": 1}
    assert transport.read_answer(200, b"", None, "x") is None
    assert transport.read_answer(200, b"tether_up 1\n", "text/plain", "x", text_ok=True) == "tether_up 1\n"
    with pytest.raises(ApiError) as bad:
        transport.read_answer(200, b"<html>", "text/html", "x")
    assert bad.value.code == transport.BAD_RESPONSE


def test_only_no_answer_is_retried_and_the_wait_grows_to_its_cap() -> None:
    assert transport.retryable(transport.unreachable("http://cp", "connection refused"))
    assert transport.unreachable("http://cp/", "timed out").code == CONTROLPLANE_UNREACHABLE
    assert not transport.retryable(ApiError(400, "tether.bad_request", "bad"))
    assert not transport.retryable(ValueError("x"))
    waits = [transport.backoff_s(a, jitter=lambda lo, hi: hi) for a in range(10)]
    assert waits == sorted(waits) and waits[0] == pytest.approx(0.1) and waits[-1] == 2.0
    assert transport.backoff_s(9, jitter=lambda lo, hi: lo) == 1.0
