"""The wire protocol's messages (tether/capability/protocol.py), pure: what one side writes the other reads back
unchanged; what does not fit a field is refused naming it; the OpenAPI schema is the same declaration."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.capability import protocol
from tether.capability.errors import ApiError
from tether.controlplane import schemas

MESSAGES = (protocol.Heartbeat, protocol.Lease, protocol.Quiesced)
text = st.text(max_size=30)
num = st.floats(allow_nan=False, allow_infinity=False, width=32)
calls = st.lists(st.dictionaries(st.sampled_from(["call_id", "url"]), text, max_size=2), max_size=3)

heartbeats = st.builds(protocol.Heartbeat, state=st.sampled_from(protocol.RUN_STATES), inflight=calls,
                       seq=st.none() | st.integers(-1, 10**9), proxy=st.none() | text, pid=st.none() | st.integers(1),
                       started_at=st.none() | num, spooled=st.integers(0, 10**6), supersedes=st.none() | text,
                       revocations_held=st.none() | st.dictionaries(text, num, max_size=3),
                       budget_slices=st.none() | st.fixed_dictionaries({
                           "asked": st.integers(0, 10**9),
                           "held": st.lists(st.text(min_size=1, max_size=64), max_size=3)}))
leases = st.builds(protocol.Lease, lease_ttl_s=num, lease_expires_at=num, now=num, run_id=text,
                   revoked=st.lists(text, max_size=3), command=st.none() | st.dictionaries(text, text, max_size=2))
acks = st.builds(protocol.Quiesced, termination_id=text, state=st.sampled_from(protocol.RUN_STATES), reports=calls,
                 starts=calls, calls=st.none() | st.dictionaries(text, st.integers(0, 9), max_size=2))


@given(st.one_of(heartbeats, leases, acks))
def test_what_one_side_writes_the_other_reads_back(message: protocol.Message) -> None:
    assert type(message).read(message.to_doc()) == message


@pytest.mark.parametrize(("doc", "field"), [
    ({"state": 3}, "state"), ({"state": "x" * 33}, "state"), ({"seq": True}, "seq"), ({"seq": 1.5}, "seq"),
    ({"inflight": [1]}, "inflight"), ({"inflight": {}}, "inflight"), ({"spooled": -1}, "spooled"),
    ({"started_at": "now"}, "started_at"), ({"revocations_held": {"j": "1"}}, "revocations_held"),
    ({"revocations_held": [1]}, "revocations_held"), ({"pid": False}, "pid"),
    ({"budget_slices": []}, "budget_slices"), ({"budget_slices": {"asked": 1, "held": [7]}}, "budget_slices"),
])
def test_a_field_that_does_not_fit_is_refused_by_name(doc: dict, field: str) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.Heartbeat.read(doc)
    assert (refused.value.http_status, refused.value.code, refused.value.details["field"]) == (
        400, "tether.bad_request", field)
    assert f"'{field}" in refused.value.message and "(the heartbeat body)" in refused.value.message


def test_required_fields_absent_or_null_are_refused_and_others_take_their_defaults() -> None:
    for doc in ({}, {"termination_id": None}):
        with pytest.raises(ApiError) as refused:
            protocol.Quiesced.read(doc)
        assert refused.value.details["field"] == "termination_id"
    ack = protocol.Quiesced.read({"termination_id": "t1", "reports": None, "future_field": 1})
    assert (ack.state, ack.reports, ack.starts, ack.calls) == (protocol.TERMINATED, [], [], None)
    assert protocol.Heartbeat.read({}) == protocol.Heartbeat()
    with pytest.raises(ApiError):
        protocol.Heartbeat.read([])  # type: ignore[arg-type]
    with pytest.raises(ApiError) as lease:
        protocol.Lease.read({"lease_ttl_s": 5, "lease_expires_at": 1, "now": 1, "run_id": "r"})
    assert lease.value.details["field"] == "revoked"


@pytest.mark.parametrize("message", MESSAGES)
def test_the_openapi_schema_is_the_declaration(message: type[protocol.Message]) -> None:
    schema = message.schema()
    names = [f.name for f in dataclasses.fields(message)]  # type: ignore[arg-type]
    assert list(schema["properties"]) == names
    assert schema.get("required", []) == [n for n, s in message.specs() if s.required]
    served = {protocol.Heartbeat: schemas.HEARTBEAT_REQUEST, protocol.Lease: schemas.LEASE,
              protocol.Quiesced: schemas.QUIESCED_REQUEST}[message]
    assert list(served["properties"]) == names


@pytest.mark.parametrize("message", MESSAGES)
def test_the_schema_states_every_bound_the_reader_enforces(message: type[protocol.Message]) -> None:
    properties = message.schema()["properties"]
    smallest = {name: "x" if spec.kind == "string" else 1 if spec.kind in ("integer", "number") else []
                for name, spec in message.specs() if spec.required}
    for name, spec in message.specs():
        if spec.kind == "string":
            assert properties[name]["maxLength"] == spec.max_len
            over = {name: "x" * (spec.max_len + 1)}
        elif spec.kind in ("objects", "strings"):
            assert properties[name]["maxItems"] == spec.max_items
            over = {name: [{} if spec.kind == "objects" else "x"] * (spec.max_items + 1)}
        else:
            continue
        with pytest.raises(ApiError) as refused:
            message.read({**smallest, **over})
        assert refused.value.details["field"] == name
