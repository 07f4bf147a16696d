"""The sidecar's MCP ledger (tether/proxy/mcpcalls.py), pure: what counts as a re-send, how long, how often."""

from __future__ import annotations

from tether.proxy.mcpcalls import ROUND_FIELDS, McpLedger, Round, fingerprint

SERVER = "http://127.0.0.1:1/mcp"


def test_a_resend_is_the_same_method_and_params_whatever_its_meta() -> None:
    first = fingerprint("tools/call", {"name": "slow", "arguments": {"s": 1}, "_meta": {"progressToken": 1}})
    again = fingerprint("tools/call", {"_meta": {"progressToken": 7}, "arguments": {"s": 1}, "name": "slow"})
    assert first == again
    assert first != fingerprint("tools/call", {"name": "slow", "arguments": {"s": 2}})
    assert first != fingerprint("prompts/get", {"name": "slow", "arguments": {"s": 1}})
    round_ = {"name": "c", "arguments": {}, "requestState": "x", "inputResponses": {"ok": {}}}
    assert fingerprint("tools/call", round_, ROUND_FIELDS) == fingerprint("tools/call", {"name": "c", "arguments": {}},
                                                                          ROUND_FIELDS)


def test_only_a_call_whose_answer_was_never_read_is_reissued_once_within_the_window() -> None:
    ledger = McpLedger(reissue_window_s=60)
    for call_id, resolution in (("done", "completed"), ("refused", "refused"), ("gone", "cancelled_not_sent")):
        ledger.watch(call_id, SERVER, call_id, call_id, ("cap",))
        ledger.resolved(call_id, resolution, now=0)
        assert ledger.reissue_of(SERVER, call_id, now=1) is None, resolution
    ledger.watch("c1", SERVER, "p", "c1", ("cap",))
    ledger.resolved("c1", "cancelled", now=0)
    origin = ledger.reissue_of(SERVER, "p", now=30)
    assert origin is not None and origin.call_id == "c1" and origin.capabilities == ("cap",)
    assert ledger.reissue_of(SERVER, "p", now=31) is None  # one re-issue per cancelled call
    ledger.watch("c2", SERVER, "p", "c1", ("cap",))  # the re-issue, itself cut: its re-send links to the first
    ledger.resolved("c2", "unknown", now=40)
    assert ledger.reissue_of(SERVER, "p", now=41).call_id == "c1"  # type: ignore[union-attr]
    ledger.watch("c3", SERVER, "q", "c3", ())
    ledger.resolved("c3", "cancelled", now=0)
    assert ledger.reissue_of(SERVER, "q", now=61) is None  # past the window
    assert ledger.reissue_of("http://other/mcp", "p", now=1) is None


def test_sessions_tasks_and_rounds_are_per_server_bounded_and_rounds_used_once() -> None:
    ledger = McpLedger(limit=2)
    ledger.issued(SERVER, "s1")
    assert ledger.knows(SERVER, "s1") and not ledger.knows("http://other/mcp", "s1")
    ledger.issued(SERVER, "s2")
    ledger.issued(SERVER, "s3")
    assert not ledger.knows(SERVER, "s1")  # the oldest is forgotten: refused from then on (fail closed)
    ledger.ended(SERVER, "s3")
    assert not ledger.knows(SERVER, "s3") and ledger.knows(SERVER, "s2")
    ledger.created(SERVER, "t1", "cap", "c1")
    assert ledger.task(SERVER, "t1").capability == "cap"  # type: ignore[union-attr]
    assert ledger.task("http://other/mcp", "t1") is None
    ledger.needs_input(SERVER, "state", Round("fp", ("cap",), "c1"))
    assert ledger.follow_up(SERVER, "state") == Round("fp", ("cap",), "c1")
    assert ledger.follow_up(SERVER, "state") is None


def test_a_task_is_read_in_both_protocols_shapes_and_nothing_else_creates_one() -> None:
    from tether.proxy.mcp import created_task

    assert created_task({"task": {"taskId": "t1", "status": "working"}}) == "t1"  # 2025-11-25
    assert created_task({"resultType": "task", "taskId": "t2", "status": "working"}) == "t2"  # 2026-07-28
    for result in ({"content": []}, {"resultType": "complete", "taskId": "t3"}, {"resultType": "task"},
                   {"task": "t4"}, {"resultType": "task", "taskId": 5}, None, []):
        assert created_task(result) is None, result


def test_a_listen_names_its_tasks_and_a_batch_may_not_repeat_a_request_id() -> None:
    import pytest

    from tether.proxy.mcp import NotJsonRpc, parse

    listen = parse(b'{"jsonrpc":"2.0","id":1,"method":"subscriptions/listen","params":{"notifications":'
                   b'{"taskIds":["a","b"],"resourceSubscriptions":["file:///x"]}}}').messages[0]
    assert (listen.tasks, listen.uris) == (("a", "b"), ("file:///x",))
    with pytest.raises(NotJsonRpc):
        parse(b'{"jsonrpc":"2.0","id":1,"method":"subscriptions/listen","params":{"notifications":{"taskIds":[1]}}}')
    update = parse(b'{"jsonrpc":"2.0","id":1,"method":"tasks/update","params":{"taskId":"a","inputResponses":{}}}')
    assert update.messages[0].task == "a" and update.messages[0].name == "a"
    with pytest.raises(NotJsonRpc):
        parse(b'[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":1,"method":"ping"}]')
    ok = parse(b'[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":"1","method":"ping"},'
               b'{"jsonrpc":"2.0","method":"notifications/initialized"}]')
    assert len(ok.messages) == 3  # 1 and "1" are different ids; notifications have none


def test_task_status_notifications_pass_only_for_the_agent_s_own_tasks() -> None:
    from tether.proxy.mcp import Visible, filter_lists_message

    visible = Visible(tool=lambda _: True, task=lambda task: task == "mine")

    def note(task: object) -> dict[str, object]:
        return {"jsonrpc": "2.0", "method": "notifications/tasks", "params": {"taskId": task, "status": "completed"}}

    assert filter_lists_message(note("mine"), visible) == (note("mine"), 0)
    assert filter_lists_message(note("theirs"), visible) == (None, 1)
    assert filter_lists_message(note(None), visible) == (None, 1)
    assert filter_lists_message([note("mine"), note("theirs")], visible) == ([note("mine")], 1)
