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

MESSAGES = (protocol.Heartbeat, protocol.Lease, protocol.Quiesced, protocol.Register, protocol.Registered,
            protocol.Events)
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

registrations = st.builds(protocol.Register, chain=text)
registereds = st.builds(protocol.Registered, agent=text, link=text, jtis=st.lists(text, max_size=3),
                        new=st.integers(0, 10), revoked=st.lists(text, max_size=3))
events_answers = st.builds(protocol.Events, events=calls, next=st.integers(-1, 10**12), resync=st.booleans(),
                           revoked=st.lists(text, max_size=3),
                           command=st.none() | st.dictionaries(text, text, max_size=2), approvals=calls)


@given(st.one_of(heartbeats, leases, acks, registrations, registereds, events_answers))
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
              protocol.Quiesced: schemas.QUIESCED_REQUEST, protocol.Register: schemas.REGISTER_REQUEST,
              protocol.Registered: schemas.REGISTERED, protocol.Events: schemas.EVENTS}[message]
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


@given(st.lists(st.text(alphabet="abc.-_", min_size=1, max_size=20), min_size=1, max_size=4))
def test_a_chain_sent_as_a_list_reads_as_its_links_joined(links: list[str]) -> None:
    assert protocol.Register.read({"chain": links}) == protocol.Register(",".join(links))


@pytest.mark.parametrize("doc", [{}, {"chain": None}, {"chain": 5}, {"chain": []}, {"chain": ["a", 1]},
                                 {"chain": {"a": "b"}}])
def test_a_registration_without_a_chain_it_can_read_is_refused_naming_chain(doc: dict) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.Register.read(doc)
    assert (refused.value.code, refused.value.details["field"]) == ("tether.bad_request", "chain")
    message = refused.value.message
    assert message == "the registration needs 'chain'" or (
        message.startswith("'chain' must be the comma-joined links or a list of links, not ")
        and message.endswith("(the registration)"))


def test_a_registration_answer_missing_a_field_or_counting_below_zero_is_refused() -> None:
    whole = {"agent": "a", "link": "h", "jtis": ["j"], "new": 0, "revoked": []}
    assert protocol.Registered.read(whole) == protocol.Registered("a", "h", ["j"], 0, [])
    for name in whole:
        with pytest.raises(ApiError) as refused:
            protocol.Registered.read({k: v for k, v in whole.items() if k != name})
        assert refused.value.details["field"] == name
    with pytest.raises(ApiError) as negative:
        protocol.Registered.read({**whole, "new": -1})
    assert "'new' must be at least 0 (the registration's answer)" in negative.value.message


def test_a_stream_line_of_events_and_next_alone_reads_as_no_resync() -> None:
    line = protocol.Events.read({"events": [{"seq": 4, "kind": "revoke"}], "next": 4})
    assert (line.resync, line.revoked, line.command, line.approvals, line.next) == (False, [], None, [], 4)


@pytest.mark.parametrize(("doc", "field"), [
    ({"next": 1}, "events"), ({"events": []}, "next"), ({"events": [], "next": "1"}, "next"),
    ({"events": [1], "next": 1}, "events"), ({"events": [], "next": 1, "resync": "yes"}, "resync"),
    ({"events": [], "next": 1, "revoked": "j"}, "revoked"), ({"events": [], "next": 1, "command": []}, "command"),
    ({"events": [], "next": 1, "approvals": [[]]}, "approvals"),
])
def test_an_events_answer_that_does_not_fit_is_refused_by_name(doc: dict, field: str) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.Events.read(doc)
    assert (refused.value.code, refused.value.details["field"]) == ("tether.bad_request", field)
    assert "the events answer" in refused.value.message


commands = st.builds(protocol.Command, termination_id=st.none() | st.text(max_size=40),
                     mode=st.sampled_from(protocol.COMMAND_MODES), window_s=st.floats(0, 1e6),
                     deadline=st.none() | num, remaining_s=st.none() | st.floats(0, 1e6), grace_s=st.floats(0, 1e3),
                     issued_at=st.none() | num, agent=st.none() | text, link=st.none() | text)


@given(commands)
def test_a_command_read_back_is_the_command_sent(command: protocol.Command) -> None:
    assert protocol.command_from(command.to_doc()) == (command, None)
    assert protocol.command_from(command.as_given()) == (command, None)
    assert None not in command.as_given().values()


def test_what_the_control_plane_sends_is_obeyed_as_sent() -> None:
    sent = {"termination_id": "t-1", "mode": "drain", "window_s": 5, "deadline": 1000.0, "grace_s": 5.0,
            "issued_at": 995.0, "link": "sha256:x", "agent": "a", "remaining_s": 4.5}
    command, problem = protocol.command_from(sent)
    assert problem is None and command.as_given() == {**sent, "window_s": 5.0}


@pytest.mark.parametrize("doc", [
    {"termination_id": "t-1", "mode": "banana"}, {"termination_id": "t-1", "window_s": "soon"},
    {"termination_id": "t-1", "window_s": -1}, {"termination_id": "t-1", "grace_s": float("nan")},
    {"termination_id": "t-1", "remaining_s": [1]}, {"termination_id": "t-1", "mode": None, "window_s": {}},
])
def test_a_command_that_cannot_be_read_is_obeyed_as_an_abort_of_its_termination(doc: dict) -> None:
    command, problem = protocol.command_from(doc)
    assert problem and command.as_given() == {"termination_id": "t-1", "mode": "abort", "window_s": 0.0,
                                              "grace_s": 10.0}


def test_a_command_that_is_not_even_an_object_or_names_no_readable_termination_still_aborts() -> None:
    for doc in (None, [], "drain", {"termination_id": 7, "mode": "drain", "window_s": "x"}):
        command, problem = protocol.command_from(doc)
        assert problem and (command.mode, command.termination_id) == ("abort", None)
    assert protocol.command_from({})[0] == protocol.Command()  # nothing wrong: a drain with the defaults, as before
