"""The console's pure parts: sessions (expiry, logout, bound), what an approver is shown of a held call, and the
search over calls."""

from __future__ import annotations

import base64
import json

from mitmproxy.test import tflow

from tether.controlplane.auth import Operator
from tether.controlplane.console.calls import find_calls, flow_id
from tether.controlplane.console.sessions import Sessions
from tether.proxy.capture import call_hash, held_call


def test_sessions_expire_end_and_stay_bounded() -> None:
    sessions = Sessions(ttl_s=60, max_sessions=2)
    who = Operator("alice", frozenset({"viewer"}))
    a = sessions.create(now=0, operator=who)
    assert sessions.get(a.sid, now=59) == a and a.csrf != a.sid
    assert sessions.get(a.sid, now=60) is None  # expired, and forgotten
    b, c = sessions.create(now=100, operator=who), sessions.create(now=101, operator=who)
    d = sessions.create(now=102, operator=who)  # over the bound: the oldest sign-in goes
    assert sessions.get(b.sid, now=103) is None and sessions.get(c.sid, 103) and sessions.get(d.sid, 103)
    assert sessions.end(c.sid) and sessions.get(c.sid, now=103) is None


def test_held_call_redacts_truncates_and_hashes_what_leaves() -> None:
    flow = tflow.tflow()
    flow.request.method = "POST"
    flow.request.headers["Authorization"] = "Bearer s3cret"
    flow.request.headers["Content-Type"] = "application/json"
    flow.request.content = json.dumps({"password": "hunter2", "pad": "x" * 20_000}).encode()
    shown = held_call(flow, frozenset({"password"}), limit=16 * 1024)
    headers = dict(shown["headers"])
    assert headers["Authorization"] == "[REDACTED]" and "hunter2" not in shown["body"]
    assert shown["body_truncated"] and len(shown["body"]) == 16 * 1024
    assert shown["body_size"] == len(flow.request.raw_content)
    assert shown["call_hash"] == call_hash(flow.request)
    before = shown["call_hash"]
    flow.request.content = flow.request.content + b" "
    assert call_hash(flow.request) != before  # any change to what leaves is another call

    flow.request.headers["Content-Type"] = "application/octet-stream"
    flow.request.content = b"\xff\xfe" * 10
    binary = held_call(flow, frozenset())
    assert binary["body_encoding"] == "base64" and base64.b64decode(binary["body"]) == b"\xff\xfe" * 10


def test_calls_are_found_by_every_word_in_any_field_newest_first() -> None:
    calls = [
        {"call_id": "c-1", "agent": "coder", "capability": "issues.read", "method": "GET", "resolution": "completed",
         "url": "https://api.example.com/repos/a/b/issues", "status": 200, "started_at": 10.0},
        {"call_id": "c-2", "agent": "coder", "capability": "issues.write", "method": "POST", "resolution": "refused",
         "code": "tether.capability_absent", "url": "https://api.example.com/repos/a/b/issues", "started_at": 20.0},
        {"call_id": "c-3", "agent": "writer", "capability": "hang.read", "method": "GET", "resolution": "unknown",
         "code": "tether.aborted", "termination_id": "term-9", "started_at": None},
    ]
    assert [c["call_id"] for c in find_calls(calls)] == ["c-2", "c-1", "c-3"]  # no start time: last
    assert [c["call_id"] for c in find_calls(calls, "CODER issues")] == ["c-2", "c-1"]
    assert [c["call_id"] for c in find_calls(calls, "coder capability_absent")] == ["c-2"]
    assert [c["call_id"] for c in find_calls(calls, "term-9")] == ["c-3"]
    assert [c["call_id"] for c in find_calls(calls, "200")] == ["c-1"]  # the status is searched too
    assert find_calls(calls, "coder aborted") == []  # every word must match
    assert [c["call_id"] for c in find_calls(calls, "", agent="coder", resolution="completed")] == ["c-1"]
    assert [c["call_id"] for c in find_calls(calls, "", agent="", resolution="")] == ["c-2", "c-1", "c-3"]


def test_a_call_names_its_captured_flow() -> None:
    assert flow_id({"capture_ref": "flows.mitm#abc-1"}) == "abc-1"
    assert flow_id({"capture_ref": "flows.mitm#"}) is None
    assert flow_id({"capture_ref": None}) is None and flow_id({}) is None
