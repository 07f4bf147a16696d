"""The wire protocol's messages (tether/capability/protocol.py), pure: what one side writes the other reads back
unchanged; what does not fit a field is refused naming it; the OpenAPI schema is the same declaration."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.capability import protocol
from tether.capability.errors import ApiError
from tether.controlplane import schemas

MESSAGES = (protocol.Heartbeat, protocol.Lease, protocol.Quiesced, protocol.Register, protocol.Registered,
            protocol.Events, protocol.ReportBatch, protocol.Accepted, protocol.SliceRequest, protocol.SliceLease,
            protocol.SliceReturn, protocol.SlicesSettled, protocol.ApprovalRequest, protocol.HeldCall,
            protocol.ApprovalFiled)
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


tags = st.text(alphabet="abcdef0123456789", min_size=1, max_size=16)
settlements = st.lists(st.builds(protocol.Settlement, slice=text, used=st.integers(0, 10**6)), max_size=3)
report_batches = st.builds(protocol.ReportBatch, reports=calls, starts=calls)
accepteds = st.builds(protocol.Accepted, accepted=st.integers(0, 10**6), duplicates=st.integers(0, 10**6))
slice_requests = st.builds(protocol.SliceRequest, capability=text, want=st.integers(1, 10**6), slice=tags,
                           seq=st.none() | st.integers(1, protocol.MAX_SLICE_SEQ), settle=settlements)
refusals = st.builds(protocol.SliceRefusal, code=st.sampled_from(["tether.budget_exhausted", "tether.rate_limited"]),
                     message=text, retry_after_s=st.none() | st.floats(0, 60), capability=st.none() | text,
                     jti=st.none() | text)
slice_leases = st.builds(protocol.SliceLease, slice=text, calls=st.integers(1, 500),
                         window_ends_in=st.none() | st.floats(0, 60)) | st.builds(
    protocol.SliceLease, slice=st.none(), calls=st.just(0), error=st.none() | refusals)
slice_returns = st.builds(protocol.SliceReturn, slices=settlements)
settleds = st.builds(protocol.SlicesSettled, settled=st.lists(st.builds(
    protocol.Settled, slice=text, used=st.integers(0, 99), returned=st.integers(0, 99)), max_size=3))
approval_requests = st.builds(protocol.ApprovalRequest, call_id=st.text(min_size=1, max_size=30),
                              capability=st.none() | text, method=st.none() | text, url=st.none() | text,
                              timeout_s=st.none() | st.floats(0, 86400), request=st.none() | st.builds(
                                  protocol.HeldCall, method=text, url=text,
                                  headers=st.lists(st.lists(text, min_size=2, max_size=2), max_size=3), body=text,
                                  body_encoding=st.sampled_from(["text", "base64"]), body_size=st.integers(-1, 10**6),
                                  body_truncated=st.booleans(), body_streamed=st.booleans(),
                                  call_hash=st.none() | text),
                              call_hash=st.none() | text, summary=st.none() | text)
decisions = st.builds(protocol.ApprovalDecision, id=st.text(min_size=1, max_size=30),
                      status=st.sampled_from(["approved", "denied", "expired", "cancelled"]),
                      call_hash=st.none() | text, call_id=st.none() | text, decided_by=st.none() | text)
fileds = st.builds(protocol.ApprovalFiled, id=st.text(min_size=1, max_size=30), status=st.none() | text,
                   expires_at=st.none() | num, call_id=st.none() | text, call_hash=st.none() | text,
                   requested_at=st.none() | num)


@given(st.one_of(heartbeats, leases, acks, registrations, registereds, events_answers, report_batches, accepteds,
                 slice_requests, slice_leases, slice_returns, settleds, approval_requests, decisions, fileds))
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
              protocol.Registered: schemas.REGISTERED, protocol.Events: schemas.EVENTS,
              protocol.ReportBatch: schemas.REPORTS_REQUEST, protocol.Accepted: schemas.ACCEPTED,
              protocol.SliceRequest: schemas.SLICE_REQUEST, protocol.SliceLease: schemas.SLICE_LEASE,
              protocol.SliceReturn: schemas.SLICE_RETURN, protocol.SlicesSettled: schemas.SLICES_SETTLED,
              protocol.ApprovalRequest: schemas.APPROVAL_REQUEST, protocol.ApprovalFiled: schemas.APPROVAL_FILED,
              protocol.HeldCall: schemas.APPROVAL_REQUEST["properties"]["request"]["anyOf"][0]}[message]
    assert list(served["properties"]) == names


@pytest.mark.parametrize("message", MESSAGES)
def test_the_schema_states_every_bound_the_reader_enforces(message: type[protocol.Message]) -> None:
    properties = message.schema()["properties"]
    smallest = {name: "x" if spec.kind == "string" else 1 if spec.kind in ("integer", "number") else []
                for name, spec in message.specs() if spec.required}
    if message is protocol.SliceLease:
        smallest["calls"] = 0  # a slice of calls names its id: the smallest answer is no slice
    for name, spec in message.specs():
        if spec.kind == "string":
            assert properties[name]["maxLength"] == spec.max_len
            over = {name: "x" * (spec.max_len + 1)}
        elif spec.kind in ("objects", "strings", "pairs"):
            assert properties[name]["maxItems"] == spec.max_items
            over = {name: [{} if spec.kind == "objects" else ["n", "v"] if spec.kind == "pairs" else "x"]
                    * (spec.max_items + 1)}
        else:
            continue
        with pytest.raises(ApiError) as refused:
            message.read({**smallest, **over})
        if (message, name) == (protocol.HeldCall, "body"):  # a held body past the bound is too large, not malformed
            assert (refused.value.http_status, refused.value.code) == (413, "tether.approval_body_too_large")
            continue
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


# -- report batches, budget slices, approvals: the documents as the code before these messages wrote them --------
def test_a_report_batch_from_spooled_lines_is_the_document_the_message_writes() -> None:
    """The fast path (lines the spool already holds, joined) writes what ``to_doc()`` would, and reads back."""
    reports = [{"call_id": "c1", "agent": "a", "resolution": "completed", "status": 200, "started_at": 1.5},
               {"call_id": "c2", "agent": "a", "resolution": "refused", "code": "tether.capability_absent"}]
    starts = [{"event": "start", "call_id": "c3", "agent": "a", "method": "GET", "url": "http://x/"}]
    lines = [json.dumps(r, separators=(",", ":")) for r in reports]
    begun = [json.dumps(r, separators=(",", ":")) for r in starts]
    whole = protocol.ReportBatch(reports, starts)
    assert protocol.ReportBatch.encoded(lines, begun) == json.dumps(whole.to_doc(), separators=(",", ":")).encode()
    assert protocol.ReportBatch.read(json.loads(protocol.ReportBatch.encoded(lines, begun))) == whole
    assert protocol.ReportBatch.read(json.loads(protocol.ReportBatch.encoded(lines))) == protocol.ReportBatch(reports)
    # As the sidecar wrote it before the message (the same bytes): reports, and starts only when there are some.
    assert protocol.ReportBatch.encoded(lines[:1]) == b'{"reports":[' + lines[0].encode() + b"]}"
    assert protocol.ReportBatch.read({"reports": None}) == protocol.ReportBatch()


# Literal documents, each as the code before these messages built it (tether/proxy/budget.py,
# tether/controlplane/services/budgets.py, tether/proxy/approvals.py, tether/controlplane/services/approvals.py).
OLD_SLICE_REQUEST = {"capability": "issues.read", "want": 4, "slice": "9f3c2a11d0e4b5a6", "seq": 3,
                     "settle": [{"slice": "run-1/0a1b2c3d4e5f6071", "used": 2}]}
OLD_SLICE_GRANTED = {"slice": "run-1/9f3c2a11d0e4b5a6", "calls": 4, "window_ends_in": None}
OLD_SLICE_RATED = {"slice": "run-1/9f3c2a11d0e4b5a6", "calls": 4, "window_ends_in": 41.25}
OLD_SLICE_SPENT = {"slice": None, "calls": 0, "error": {
    "code": "tether.budget_exhausted", "message": "issues.read: root's calls=5 budget is spent (it is shared with "
    "every delegate below it); ask its issuer for a new grant", "capability": "issues.read", "jti": "j-root"}}
OLD_SLICE_RATE_LIMITED = {"slice": None, "calls": 0, "error": {
    "code": "tether.rate_limited", "retry_after_s": 12.5, "message": "issues.read: root's per_minute=10 is used up "
    "in this 60s window; retry in 12.5s", "capability": "issues.read", "jti": "j-root"}}
OLD_SLICE_RETURN = {"slices": [{"slice": "run-1/9f3c2a11d0e4b5a6", "used": 1}]}
OLD_SETTLED = {"settled": [{"slice": "run-1/9f3c2a11d0e4b5a6", "used": 1, "returned": 3}]}
HELD = {"method": "POST", "url": "http://127.0.0.1:7101/tickets", "headers": [["content-type", "application/json"]],
        "body": "{}", "body_encoding": "text", "body_size": 2, "body_truncated": False, "body_streamed": False,
        "call_hash": "sha256:ab"}
OLD_APPROVAL_REQUEST = {"call_id": "c-7", "capability": "tickets.write", "method": "POST",
                        "url": "http://127.0.0.1:7101/tickets", "timeout_s": 300.0, "request": HELD,
                        "call_hash": "sha256:ab"}
OLD_APPROVAL = {"id": "apr-0123456789ab", "agent": "root", "link": "sha256:l", "run_id": "run-1", "call_id": "c-7",
                "capability": "tickets.write", "method": "POST", "url": "http://127.0.0.1:7101/tickets",
                "summary": "", "request": HELD, "call_hash": "sha256:ab", "chain": ["root"],
                "deciders": ["approver", "admin"], "status": "pending", "requested_at": 10.0, "expires_at": 310.0,
                "decided_at": None, "decided_by": None, "version": 1}


def test_the_budget_documents_both_sides_wrote_before_are_read_and_written_the_same() -> None:
    ask = protocol.SliceRequest.read(OLD_SLICE_REQUEST)
    assert (ask.capability, ask.want, ask.slice, ask.seq) == ("issues.read", 4, "9f3c2a11d0e4b5a6", 3)
    assert ask.settle == [protocol.Settlement("run-1/0a1b2c3d4e5f6071", 2)]
    assert json.dumps(ask.to_doc()) == json.dumps(OLD_SLICE_REQUEST)  # same keys, same order, same bytes
    older = protocol.SliceRequest.read({"capability": "c", "want": 1, "slice": "t", "settle": []})  # no seq yet
    assert (older.seq, older.settle) == (None, [])
    assert protocol.SliceRequest.read({"capability": "c", "slice": "t"}).want == 1  # want absent: one, as before
    granted = protocol.SliceLease.read(OLD_SLICE_GRANTED)
    assert (granted.slice, granted.calls, granted.window_ends_in, granted.error) == (
        "run-1/9f3c2a11d0e4b5a6", 4, None, None)
    assert protocol.SliceLease.read(OLD_SLICE_RATED).window_ends_in == 41.25
    spent = protocol.SliceLease.read(OLD_SLICE_SPENT)
    assert spent.calls == 0 and spent.error == protocol.SliceRefusal(
        "tether.budget_exhausted", OLD_SLICE_SPENT["error"]["message"], None, "issues.read", "j-root")
    limited = protocol.SliceLease.read(OLD_SLICE_RATE_LIMITED)
    assert limited.error is not None and (limited.error.code, limited.error.retry_after_s) == (
        "tether.rate_limited", 12.5)
    # What the control plane writes now holds every field it wrote before, with the same values.
    for old in (OLD_SLICE_GRANTED, OLD_SLICE_SPENT, OLD_SLICE_RATE_LIMITED):
        new = protocol.SliceLease.read(old).to_doc()
        assert {k: new[k] for k in old if k != "error"} == {k: v for k, v in old.items() if k != "error"}
        if "error" in old:
            assert {k: new["error"][k] for k in old["error"]} == old["error"]
    back = protocol.SliceReturn.read(OLD_SLICE_RETURN)
    assert back.slices == [protocol.Settlement("run-1/9f3c2a11d0e4b5a6", 1)]
    assert json.dumps(back.to_doc()) == json.dumps(OLD_SLICE_RETURN)
    settled = protocol.SlicesSettled.read(OLD_SETTLED)
    assert settled.settled == [protocol.Settled("run-1/9f3c2a11d0e4b5a6", 1, 3)]
    assert settled.to_doc() == OLD_SETTLED


def test_the_approval_documents_both_sides_wrote_before_are_read_and_written_the_same() -> None:
    ask = protocol.ApprovalRequest.read(OLD_APPROVAL_REQUEST)
    assert (ask.call_id, ask.timeout_s, ask.call_hash, ask.summary) == ("c-7", 300.0, "sha256:ab", None)
    assert ask.request == protocol.HeldCall("POST", "http://127.0.0.1:7101/tickets", [["content-type",
                                            "application/json"]], "{}", "text", 2, False, False, "sha256:ab")
    assert json.dumps(ask.to_doc()) == json.dumps(OLD_APPROVAL_REQUEST)  # summary unset: left out, as before
    # The held call as stored (the control plane's old route wrote these keys, in this order) reads and writes
    # back the same.
    assert json.dumps(protocol.HeldCall.read(HELD).to_doc()) == json.dumps(HELD)
    # An approval document stored before (the answer to a filing was the approval, whole) still reads.
    filed = protocol.ApprovalFiled.read(OLD_APPROVAL)
    assert (filed.id, filed.status, filed.expires_at, filed.call_id, filed.call_hash, filed.requested_at) == (
        "apr-0123456789ab", "pending", 310.0, "c-7", "sha256:ab", 10.0)
    decided = {**OLD_APPROVAL, "status": "approved", "decided_at": 20.0, "decided_by": "alice"}
    assert protocol.decision_from(decided) == (protocol.ApprovalDecision("apr-0123456789ab", "approved",
                                                                         "sha256:ab", "c-7", "alice"), None)
    old_event = {"id": "apr-1", "call_id": "c-7", "status": "denied", "decided_by": "bob", "call_hash": "sha256:ab"}
    assert protocol.ApprovalDecision.read(old_event).to_doc() == old_event  # the event payload, same keys


@pytest.mark.parametrize(("held", "field"), [
    ({"headers": "content-type: x"}, "request.headers"), ({"headers": [["a"]]}, "request.headers"),
    ({"headers": [["a", 1]]}, "request.headers"), ({"headers": [["a", "x" * (64 * 1024 + 1)]]}, "request.headers"),
    ({"headers": [["a", "b"]] * 501}, "request.headers"), ({"method": 5}, "request.method"),
    ({"method": "X" * 33}, "request.method"), ({"url": None, "body": 7}, "request.body"),
    ({"body_encoding": "gzip"}, "request.body_encoding"), ({"body_size": "abc"}, "request.body_size"),
    ({"body_size": None}, "request.body_size"), ({"body_size": -2}, "request.body_size"),
    ({"body_truncated": "no"}, "request.body_truncated"), ({"call_hash": "h" * 81}, "request.call_hash"),
])
def test_a_held_call_that_does_not_fit_is_refused_naming_its_field(held: dict, field: str) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.ApprovalRequest.read({"call_id": "c", "request": {**HELD, **held}})
    assert (refused.value.http_status, refused.value.code, refused.value.details["field"]) == (
        400, "tether.bad_request", field)
    assert f"'{field.split('.')[1]}'" in refused.value.message and refused.value.message.startswith("'request': ")


@pytest.mark.parametrize("held", [{"body_truncated": True}, {"body_streamed": True, "body_size": -1},
                                  {"body_size": protocol.APPROVAL_BODY_LIMIT + 1},
                                  {"body": "x" * (protocol.MAX_HELD_BODY + 1)}])
def test_a_held_call_that_is_not_whole_is_too_large(held: dict) -> None:
    try:
        ask = protocol.ApprovalRequest.read({"call_id": "c", "request": {**HELD, **held}})
        assert ask.request is not None
        refused = ask.request.cut()
    except ApiError as exc:  # a body past the limit: refused as it is read
        refused = exc
    assert refused is not None and (refused.http_status, refused.code) == (413, "tether.approval_body_too_large")
    assert refused.details["limit"] == protocol.APPROVAL_BODY_LIMIT
    assert protocol.HeldCall.read(HELD).cut() is None


@pytest.mark.parametrize(("doc", "field"), [
    ({"slice": "t"}, "capability"), ({"capability": "c"}, "slice"), ({"capability": 5, "slice": "t"}, "capability"),
    ({"capability": "c", "slice": "t", "want": 0}, "want"), ({"capability": "c", "slice": "t", "want": "2"}, "want"),
    ({"capability": "c", "slice": "t", "want": 1.5}, "want"), ({"capability": "c", "slice": ""}, "slice"),
    ({"capability": "c", "slice": "a/b"}, "slice"), ({"capability": "c", "slice": "x" * 65}, "slice"),
    ({"capability": "c", "slice": "t", "seq": 0}, "seq"), ({"capability": "c", "slice": "t", "seq": 10**12}, "seq"),
    ({"capability": "c", "slice": "t", "seq": True}, "seq"),
    ({"capability": "c", "slice": "t", "settle": {}}, "settle"),
    ({"capability": "c", "slice": "t", "settle": [{"slice": "s", "used": -1}]}, "settle"),
    ({"capability": "c", "slice": "t", "settle": [{"slice": "s", "used": "1"}]}, "settle"),
    ({"capability": "c", "slice": "t", "settle": [{"used": 1}]}, "settle"),
    ({"capability": "c", "slice": "t", "settle": [1]}, "settle"),
])
def test_a_slice_request_that_does_not_fit_is_refused_by_name(doc: dict, field: str) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.SliceRequest.read(doc)
    assert (refused.value.http_status, refused.value.code, refused.value.details["field"]) == (
        400, "tether.bad_request", field)
    assert "(the slice request)" in refused.value.message or "the slice request needs" in refused.value.message


def test_a_nested_refusal_says_where_inside_the_field() -> None:
    with pytest.raises(ApiError) as refused:
        protocol.SliceReturn.read({"slices": [{"slice": "r/a", "used": 1}, {"slice": "r/b", "used": "x"}]})
    assert refused.value.details["field"] == "slices"
    assert refused.value.message.startswith("'slices[1]': 'used' must be an integer, not a string")


@pytest.mark.parametrize("doc", [
    [], {"calls": "4", "slice": "r/t"}, {"calls": 4}, {"calls": -1}, {"slice": "r/t"}, {"calls": 4, "slice": 7},
    {"calls": 0, "error": {"message": "no code"}}, {"calls": 0, "error": "spent"},
    {"calls": 4, "slice": "r/t", "window_ends_in": "soon"}, {"calls": 0, "error": {"code": "x", "retry_after_s": -1}},
])
def test_a_slice_answer_that_cannot_be_read_is_refused(doc: object) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.SliceLease.read(doc)  # type: ignore[arg-type]
    assert refused.value.code == "tether.bad_request"


@pytest.mark.parametrize(("doc", "field"), [
    ({}, "call_id"), ({"call_id": ""}, "call_id"), ({"call_id": 5}, "call_id"), ({"call_id": "x" * 201}, "call_id"),
    ({"call_id": "c", "timeout_s": None}, "timeout_s"), ({"call_id": "c", "timeout_s": -1}, "timeout_s"),
    ({"call_id": "c", "request": []}, "request"), ({"call_id": "c", "method": "x" * 33}, "method"),
    ({"call_id": "c", "request": {"headers": 5}}, "request.headers"),
    ({"call_id": "c", "summary": None}, "summary"), ({"call_id": "c", "url": ["u"]}, "url"),
])
def test_an_approval_request_that_does_not_fit_is_refused_by_name(doc: dict, field: str) -> None:
    with pytest.raises(ApiError) as refused:
        protocol.ApprovalRequest.read(doc)
    assert (refused.value.code, refused.value.details["field"]) == ("tether.bad_request", field)


@pytest.mark.parametrize("doc", [{"id": "apr-1", "status": 3}, {"id": "apr-1", "call_hash": ["h"]},
                                 {"id": "apr-1", "status": "x" * 33}])
def test_a_decision_that_cannot_be_read_denies_the_approval_it_names(doc: dict) -> None:
    decision, problem = protocol.decision_from(doc)
    assert problem and decision == protocol.ApprovalDecision("apr-1", "denied", None)


@pytest.mark.parametrize("doc", [None, [], "approved", {}, {"id": 5, "status": "approved"}, {"id": ""}])
def test_a_decision_naming_no_approval_is_dropped(doc: object) -> None:
    decision, problem = protocol.decision_from(doc)
    assert decision is None and problem


def test_a_decision_without_a_status_is_a_denial_as_before() -> None:
    assert protocol.decision_from({"id": "apr-1"}) == (protocol.ApprovalDecision("apr-1", "denied", None), None)
