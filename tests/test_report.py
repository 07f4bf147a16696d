"""The one shape of a call report (tether/capability/report.py): what the sidecar's call table produces is what
the control plane reads back unchanged, and a report with a field of the wrong type is refused naming it."""

from __future__ import annotations

import json

import pytest

from tether.capability.errors import BAD_REQUEST
from tether.capability.report import IN_FLIGHT_FIELDS, RECORD_FIELDS, CallReport, ReportInvalid
from tether.proxy.state import Call, CallTable


def test_a_call_reported_by_the_sidecar_reads_back_unchanged() -> None:
    table = CallTable()
    call = table.start(Call("c-1", "agent-a", "GET", "https://api.example/x", 100.0, capability="x.read",
                            tier="direct", phase="forwarding", capture_ref="cap/1"))
    summary = call.summary()
    assert set(summary) == {*IN_FLIGHT_FIELDS, "phase"} and summary["phase"] == "forwarding"
    done = table.resolve("c-1", "completed", 101.5, status=200)
    assert done is not None
    sent = json.loads(json.dumps(done.report()))  # as the spool and the wire carry it
    report = CallReport.read(sent)
    assert report.to_doc() == {**sent, "run_id": None}  # no run id is sent: the control plane stamps it
    assert set(RECORD_FIELDS) <= set(sent) and "phase" not in sent
    assert (report.resolution, report.status, report.ended_at) == ("completed", 200, 101.5)


def test_a_start_is_a_report_without_an_end() -> None:
    start = CallReport.read({"call_id": "c-2", "agent": "a", "method": "POST", "url": "http://x/", "started_at": 3,
                             "event": "start"})
    assert start.resolution is None and "event" not in start.to_doc()


@pytest.mark.parametrize(("doc", "field", "words"), [
    ({"call_id": 5}, "call_id", "'call_id' must be a string, not a number"),
    ({}, "call_id", "needs 'call_id'"),
    ({"call_id": ""}, "call_id", "must not be empty"),
    ({"call_id": "x" * 201}, "call_id", "longer than 200"),
    ({"call_id": "c", "status": "200"}, "status", "'status' must be an integer, not a string"),
    ({"call_id": "c", "status": 200.5}, "status", "must be an integer"),
    ({"call_id": "c", "started_at": True}, "started_at", "must be a number, not a boolean"),
    ({"call_id": "c", "ended_at": float("inf")}, "ended_at", "finite"),
    ({"call_id": "c", "agent": ["a"]}, "agent", "'agent' must be a string, not a list"),
    ({"call_id": "c", "run_id": "r" * 65}, "run_id", "longer than 64"),
])
def test_a_report_with_a_wrong_field_is_refused_naming_it(doc: dict, field: str, words: str) -> None:
    with pytest.raises(ReportInvalid) as info:
        CallReport.read(doc, "reports[3]")
    assert info.value.code == BAD_REQUEST
    assert words in info.value.message and info.value.message.startswith("reports[3]")
    assert info.value.details.get("field") == field
