"""Tasks and multi-round-trip calls through the sidecar.

Tasks: the SDK 2.3 defines the task types but runs no tasks, so the server (``tests/mcp_next.NextServer``, the
SDK's ``MCPServer``) has a hand-written task store behind an SDK extension, and the client here speaks the
task methods' JSON-RPC by hand (2025-11-25, in a session). A task id is bound to the call that created it:
only the agent whose sidecar saw it created reaches it, ``tasks/list`` shows it only its own.

Multi-round-trip (2026-07-28): the SDK client answers an ``input_required`` result (an elicitation) and retries
the call with ``requestState``; an approval-tier call is held once, its follow-up round is not, and a replay of
that round is a new call (held again)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import httpx
import pytest
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp_types import CallToolResult, EmptyResult, Request, RequestParams, Result
from pydantic import ConfigDict

from .harness import wait_until
from .mcp_next import HEADERS, MODERN, TASKS_EXTENSION, WAIT, NextWorld, next_world
from .test_mcp_sessions import open_session, rpc, with_session

ABSENT = "tether.capability_absent"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NextWorld]:
    yield from next_world(tmp_path_factory.mktemp("mcp-tasks"))


def answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON-RPC answer in a JSON or SSE body."""
    assert response.status_code == 200, (response.status_code, response.text)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        datas = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
        values = [json.loads(d) for d in datas if d]
        return next(v for v in values if "result" in v or "error" in v)
    return response.json()


def refused(doc: dict[str, Any], code: str = ABSENT) -> None:
    assert "error" in doc and doc["error"]["data"]["code"] == code, doc


class Agent:
    def __init__(self, http: httpx.Client, url: str) -> None:
        self.http, self.url = http, url
        self.session = open_session(http, url)
        self.next_id = 10

    def call(self, method: str, params: dict[str, Any], **headers: str) -> dict[str, Any]:
        self.next_id += 1
        return answer(self.http.post(self.url, json=rpc(method, params, self.next_id),
                                     headers={**with_session(self.session), **headers}))


def test_a_task_is_reached_only_through_the_sidecar_that_saw_it_created(world: NextWorld) -> None:
    caps = {"next.job": "direct", "next.add": "direct"}
    first, second = world.sidecar("task-first", caps), world.sidecar("task-second", caps)
    url = world.server.url
    with httpx.Client(proxy=first.proxy, trust_env=False, timeout=WAIT) as a_http, \
            httpx.Client(proxy=second.proxy, trust_env=False, timeout=WAIT) as b_http:
        a, b = Agent(a_http, url), Agent(b_http, url)
        theirs = b.call("tools/call", {"name": "job", "arguments": {"n": 2}, "task": {"ttl": 60000}})
        their_task = theirs["result"]["task"]["taskId"]
        created = a.call("tools/call", {"name": "job", "arguments": {"n": 1}, "task": {"ttl": 60000}})
        task = created["result"]["task"]["taskId"]

        assert a.call("tasks/get", {"taskId": task})["result"]["taskId"] == task
        assert a.call("tasks/result", {"taskId": task})["result"]["content"][0]["text"] == "job 1 done"
        listed = a.call("tasks/list", {})["result"]["tasks"]
        assert [t["taskId"] for t in listed] == [task]  # the server knows both; the agent sees its own
        assert {t["taskId"] for t in b.call("tasks/list", {})["result"]["tasks"]} == {their_task}

        before = list(world.server.calls)
        refused(a.call("tasks/get", {"taskId": their_task}))
        refused(a.call("tasks/result", {"taskId": their_task}))
        refused(a.call("tasks/cancel", {"taskId": their_task}))
        refused(a.call("tasks/get", {"taskId": "task-made-up"}))
        refused(a.call("tasks/get", {"taskId": task}, **{"mcp-name": their_task}))  # the header must say the body
        assert world.server.calls == before  # none of them reached the server
        assert a.call("tasks/cancel", {"taskId": task})["result"]["status"] == "cancelled"

    reports = wait_until(lambda: len(r := [x for x in world.reports("task-first") if x["method"] == "POST"]) >= 12
                         and r, WAIT, what="the first agent's reports")
    governed = [r for r in reports if "(task of call " in (r.get("detail") or "")]
    assert len(governed) == 3 and all(r["capability"] == "next.job" for r in governed), governed
    refusals = [r for r in reports if r["resolution"] == "refused"]
    assert len(refusals) == 5 and all(r["code"] == ABSENT for r in refusals), refusals


def test_a_task_of_a_tool_the_agent_does_not_hold_is_never_created_so_never_reached(world: NextWorld) -> None:
    sidecar = world.sidecar("task-nojob", {"next.add": "direct"})
    created = len([c for c in world.server.calls if c.startswith("task job")])
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=WAIT) as http:
        agent = Agent(http, world.server.url)
        made = agent.call("tools/call", {"name": "job", "arguments": {"n": 3}, "task": {"ttl": 1000}})
        assert made["result"]["isError"] and made["result"]["_meta"]["tether/error"]["code"] == ABSENT, made
        assert agent.call("tasks/list", {})["result"]["tasks"] == []  # the server's tasks are other agents'
    assert len([c for c in world.server.calls if c.startswith("task job")]) == created


# -- multi-round-trip results ----------------------------------------------------------------------------
def modern_headers(tool: str) -> dict[str, str]:
    return {**HEADERS, "mcp-protocol-version": MODERN, "mcp-method": "tools/call", "mcp-name": tool}


def pending_approvals(world: NextWorld, agent: str) -> list[dict[str, Any]]:
    return [a for a in world.cp.client().request("GET", "/v1/approvals?status=pending") if a.get("agent") == agent]


def decide_when_held(world: NextWorld, agent: str, decision: str) -> threading.Thread:
    """A person who approves (or denies) the agent's next held call as soon as it is held; started."""
    def decide() -> None:
        held = wait_until(lambda: pending_approvals(world, agent), WAIT, what=f"a held call of {agent}")
        world.cp.client().request("POST", f"/v1/approvals/{held[0]['id']}/{decision}")

    person = threading.Thread(target=decide)
    person.start()
    return person


def test_an_approval_covers_its_calls_follow_up_rounds_and_a_replayed_round_is_held_again(world: NextWorld) -> None:
    from mcp.types import ElicitResult

    agent = "rounds"
    sidecar = world.sidecar(agent, {"next.confirm": {"tier": "approval", "calls": 1}, "next.add": "direct"})
    world.server.calls.clear()
    asked: list[str] = []

    async def elicit(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        return ElicitResult(action="accept", content={})

    approver = decide_when_held(world, agent, "approve")

    async def body(client: Client) -> Any:
        return await client.call_tool("confirm", {"action": "ship"})

    result = world.session(sidecar, MODERN, body, elicitation_callback=elicit)
    approver.join()
    assert not result.is_error and result.content[0].text == "did ship", result
    assert asked == ["really ship?"]
    assert world.server.calls == ["confirm asks ship", "confirm does ship"]
    reports = wait_until(lambda: len(r := world.tool_reports(agent, "next.confirm")) == 2 and r, WAIT,
                         what="both rounds reported")
    assert [r["resolution"] for r in reports] == ["completed", "completed"]
    assert "input_required round of call " + reports[0]["call_id"] in reports[1]["detail"], reports[1]
    assert not pending_approvals(world, agent)  # the one approval covered both rounds

    # The round replayed by hand (its requestState was used already) is a new call: held again (denied here).
    replay = next(json.loads(body) for _, _, body in world.wiretap.requests if b'"requestState"' in body)
    replay["id"] = 99

    denier = decide_when_held(world, agent, "deny")
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=WAIT) as http:
        replayed = answer(http.post(world.server.url, json=replay, headers=modern_headers("confirm")))
    denier.join()
    assert replayed["result"]["isError"], replayed
    assert replayed["result"]["_meta"]["tether/error"]["code"] == "tether.approval_denied", replayed
    assert world.server.calls.count("confirm does ship") == 1


def test_a_follow_up_round_is_refused_once_the_chain_is_revoked(world: NextWorld) -> None:
    import asyncio

    from mcp.types import ElicitResult

    agent = "rounds-revoked"
    identity = world.cp.issue(agent, {"next.confirm": "approval", "next.add": "direct"})
    sidecar = world.sidecar_of(identity)
    admin = world.cp.client()
    world.server.calls.clear()
    probe = {"jsonrpc": "2.0", "id": "probe", "method": "tools/list",
             "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}}

    def revoked() -> bool:
        with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=WAIT) as http:
            headers = {**HEADERS, "mcp-protocol-version": MODERN, "mcp-method": "tools/list"}
            return http.post(world.server.url, json=probe, headers=headers).headers.get(
                "tether-error") == "tether.chain_revoked"

    async def elicit(context: Any, params: Any) -> ElicitResult:
        # Between the rounds: revoke, and answer only once the sidecar knows.
        await asyncio.to_thread(admin.request, "POST", f"/v1/grants/{identity.jti}/revoke", {"reason": "test"})
        await asyncio.to_thread(wait_until, revoked, WAIT, 0.1, "the sidecar to learn of the revocation")
        return ElicitResult(action="accept", content={})

    approver = decide_when_held(world, agent, "approve")

    async def body(client: Client) -> Any:
        return await client.call_tool("confirm", {"action": "launch"})

    result = world.session(sidecar, MODERN, body, elicitation_callback=elicit)
    approver.join()
    assert result.is_error and result.meta["tether/error"]["code"] == "tether.chain_revoked", result
    assert world.server.calls == ["confirm asks launch"]  # the follow-up never reached the server


def test_a_held_call_the_agent_cancels_does_not_leave_when_approved(world: NextWorld) -> None:
    agent = "held-cancelled"
    sidecar = world.sidecar(agent, {"next.add": "approval"})
    admin = world.cp.client()
    before = world.server.calls.count("add")
    answers: list[dict[str, Any]] = []
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=WAIT) as http, \
            httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=WAIT) as other:
        a = Agent(http, world.server.url)
        caller = threading.Thread(target=lambda: answers.append(
            a.call("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}})))
        caller.start()
        held = wait_until(lambda: pending_approvals(world, agent), WAIT, what="the held call")
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": a.next_id, "reason": "the user gave up"}}
        assert other.post(world.server.url, json=cancel, headers=with_session(a.session)).status_code in (200, 202)
        admin.request("POST", f"/v1/approvals/{held[0]['id']}/approve")
        caller.join(WAIT)
    assert answers and answers[0]["result"]["_meta"]["tether/error"]["code"] == "tether.client_cancelled", answers
    assert world.server.calls.count("add") == before  # approved, but the agent had cancelled it: never sent
    report = wait_until(lambda: world.tool_reports(agent, "next.add"), WAIT, what="the call's report")[0]
    assert (report["resolution"], report["code"]) == ("cancelled_not_sent", "tether.client_cancelled"), report


# -- the 2026-07-28 tasks extension (SEP-2663), with the SDK client ----------------------------------------
class TaskHandle(Result):
    """A ``tools/call`` answered with a task (``resultType: "task"``): the fields tether binds on."""

    result_type: Literal["task"] = "task"
    task_id: str
    status: str


class GetTaskParams(RequestParams):
    task_id: str


class UpdateTaskParams(GetTaskParams):
    input_responses: dict[str, Any]


class GetTask(Request[GetTaskParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param: ClassVar[str | None] = "taskId"  # the SDK mirrors it into Mcp-Name, as SEP-2663 asks


class UpdateTask(Request[UpdateTaskParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    name_param: ClassVar[str | None] = "taskId"


class CancelTask(Request[GetTaskParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param: ClassVar[str | None] = "taskId"


class Polled(Result):
    """A ``tasks/get`` answer: a DetailedTask."""

    model_config = ConfigDict(extra="allow")
    task_id: str
    status: str
    result: dict[str, Any] | None = None


class TasksClient(ClientExtension):
    """The client side of the tasks extension, as the SDK's extension surface is meant to carry it: a claim on
    ``resultType: "task"`` whose resolver polls ``tasks/get`` until the task ends. ``created`` keeps every task id."""

    identifier = TASKS_EXTENSION

    def __init__(self) -> None:
        self.created: list[str] = []
        self.polls = 0

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskHandle, resolve=self.resolve)]

    async def resolve(self, handle: TaskHandle, ctx: ClaimContext) -> CallToolResult:
        import asyncio

        self.created.append(handle.task_id)
        while True:
            self.polls += 1
            polled = await ctx.session.send_request(GetTask(params=GetTaskParams(task_id=handle.task_id)), Polled)
            if polled.status == "completed" and polled.result is not None:
                return CallToolResult.model_validate(polled.result)
            assert polled.status == "working", polled
            await asyncio.sleep(0.05)


def modern_rpc(method: str, params: dict[str, Any], id_: Any = 1) -> dict[str, Any]:
    """A stateless (2026-07-28) request as a client writes it, the tasks extension declared."""
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXTENSION: {}}}}
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": {**params, "_meta": meta}}


def post_modern(http: httpx.Client, url: str, method: str, params: dict[str, Any], name: str | None = None,
                id_: Any = 1) -> dict[str, Any]:
    headers = {**HEADERS, "mcp-protocol-version": MODERN, "mcp-method": method}
    if name is not None:
        headers["mcp-name"] = name
    return answer(http.post(url, json=modern_rpc(method, params, id_), headers=headers))


def test_a_2026_task_is_polled_through_its_own_sidecar_only(world: NextWorld) -> None:
    caps = {"next.job": "direct", "next.add": "direct"}
    owner, other = world.sidecar("modern-owner", caps), world.sidecar("modern-other", caps)
    tasks = TasksClient()

    async def body(client: Client) -> Any:
        done = await client.call_tool("job", {"n": 7})
        task = tasks.created[0]
        await client.session.send_request(
            UpdateTask(params=UpdateTaskParams(task_id=task, input_responses={"ok": {"action": "accept"}})),
            EmptyResult)
        await client.session.send_request(CancelTask(params=GetTaskParams(task_id=task)), EmptyResult)
        return done

    done = world.session(owner, MODERN, body, extensions=[tasks])
    assert not done.is_error and done.content[0].text == "job 7 done", done
    [task] = tasks.created
    assert tasks.polls == 2  # working, then completed with the result
    assert world.server.calls.count(f"tasks/get {task}") == 2
    assert f"tasks/update {task} ['ok']" in world.server.calls and f"tasks/cancel {task}" in world.server.calls

    before = list(world.server.calls)
    with httpx.Client(proxy=other.proxy, trust_env=False, timeout=WAIT) as http:
        url = world.server.url
        for method, params in (("tasks/get", {"taskId": task}), ("tasks/cancel", {"taskId": task}),
                               ("tasks/update", {"taskId": task, "inputResponses": {"ok": {"action": "accept"}}})):
            refused(post_modern(http, url, method, params, task))
        listen = post_modern(http, url, "subscriptions/listen", {"notifications": {"taskIds": [task]}})
        refused(listen)  # its status notifications would carry the owner's result
    with httpx.Client(proxy=owner.proxy, trust_env=False, timeout=WAIT) as http:
        # The owner's own sidecar: the header must name the body's task (a router would send it elsewhere).
        refused(post_modern(http, world.server.url, "tasks/get", {"taskId": task}, "task-someone-else"))
        refused(post_modern(http, world.server.url, "tasks/get", {"taskId": "task-made-up"}, "task-made-up"))
    assert world.server.calls == before  # none of it reached the server

    reports = wait_until(lambda: len(r := [x for x in world.reports("modern-owner") if x["method"] == "POST"
                                           and (x.get("detail") or "").find("task of call") >= 0]) >= 4 and r,
                         WAIT, what="the owner's task reports")
    creating = next(r for r in world.tool_reports("modern-owner", "next.job") if "task of call" not in
                    (r.get("detail") or ""))
    assert all(r["capability"] == "next.job" and f"task of call {creating['call_id']}" in r["detail"]
               and r["resolution"] == "completed" for r in reports), reports
    assert {r["detail"].split(" (")[0] for r in reports} == {"mcp tasks/get", "mcp tasks/update", "mcp tasks/cancel"}
    other_reports = wait_until(lambda: len(r := [x for x in world.reports("modern-other")
                                                 if x["resolution"] == "refused"]) >= 4 and r, WAIT,
                               what="the other agent's refusals")
    assert all(r["code"] == ABSENT for r in other_reports), other_reports


def test_a_2026_task_counts_once_against_a_budget_and_not_at_all_when_absent(world: NextWorld) -> None:
    budgeted = world.sidecar("modern-budget", {"next.job": {"tier": "direct", "calls": 1}, "next.add": "direct"})
    absent = world.sidecar("modern-absent", {"next.add": "direct"})
    tasks = TasksClient()

    async def body(client: Client) -> tuple[Any, Any]:
        return await client.call_tool("job", {"n": 1}), await client.call_tool("job", {"n": 2})

    first, second = world.session(budgeted, MODERN, body, extensions=[tasks])
    assert not first.is_error and first.content[0].text == "job 1 done", first
    assert tasks.polls == 2  # the polls took no unit of the budget of one call; the second call finds it spent
    assert second.is_error and second.meta["tether/error"]["code"] == "tether.budget_exhausted", second
    assert len(tasks.created) == 1

    created = [c for c in world.server.calls if c.startswith("task job")]
    never = TasksClient()

    async def absent_body(client: Client) -> Any:
        return await client.call_tool("job", {"n": 3})

    refused_call = world.session(absent, MODERN, absent_body, extensions=[never])
    assert refused_call.is_error and refused_call.meta["tether/error"]["code"] == ABSENT, refused_call
    assert never.created == [] and [c for c in world.server.calls if c.startswith("task job")] == created

    reports = wait_until(lambda: len(r := world.tool_reports("modern-budget", "next.job")) == 4 and r, WAIT,
                         what="the budgeted agent's reports")
    assert [r["resolution"] for r in reports] == ["completed", "completed", "completed", "refused"], reports
    assert reports[-1]["code"] == "tether.budget_exhausted"


def test_a_2026_task_after_its_agent_is_terminated(world: NextWorld) -> None:
    """The creating call and the polls before the end are in the record; a poll after it is refused, and never
    reaches the server."""
    agent = "modern-terminated"
    sidecar = world.sidecar(agent, {"next.job": "direct", "next.add": "direct"})
    admin = world.cp.client()
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=WAIT) as http:
        url = world.server.url
        handle = post_modern(http, url, "tools/call", {"name": "job", "arguments": {"n": 9}}, "job")
        task = handle["result"]["taskId"]
        assert handle["result"]["resultType"] == "task", handle
        assert post_modern(http, url, "tasks/get", {"taskId": task}, task)["result"]["status"] == "working"
        tid = admin.request("POST", f"/v1/agents/{agent}/terminate", {"mode": "abort", "reason": "test"})["id"]
        wait_until(lambda: admin.request("GET", f"/v1/terminations/{tid}")["state"] == "terminated", WAIT,
                   what="the termination")
        after = post_modern(http, url, "tasks/get", {"taskId": task}, task)
    refused(after, "tether.terminated")
    assert world.server.calls.count(f"tasks/get {task}") == 1  # the poll after the end never left

    record = admin.request("GET", f"/v1/records/{tid}")
    mine = sorted((c for c in record["calls"] if c.get("capability") == "next.job"), key=lambda c: c["started_at"])
    assert [c["resolution"] for c in mine] == ["completed", "completed"], mine  # the call and its poll
    poll = next(r for r in world.reports(agent) if r["call_id"] == mine[1]["call_id"])
    assert f"mcp tasks/get (task of call {mine[0]['call_id']})" == poll["detail"], poll
    last = wait_until(lambda: [r for r in world.reports(agent) if r.get("code") == "tether.terminated"], WAIT,
                      what="the refused poll reported")
    assert last[0]["resolution"] == "refused", last


def test_tasks_created_in_a_batch_belong_to_the_calls_that_created_them(world: NextWorld) -> None:
    """One batch, two task-creating calls (one in each protocol's shape): each task is bound to its call, so its
    agent polls it and another agent cannot."""
    caps = {"next.job": "direct", "next.add": "direct"}
    owner, other = world.sidecar("batch-owner", caps), world.sidecar("batch-other", caps)
    legacy = rpc("tools/call", {"name": "job", "arguments": {"n": 4}, "task": {"ttl": 60000}}, 1)
    modern = modern_rpc("tools/call", {"name": "job", "arguments": {"n": 5}}, 2)
    with httpx.Client(proxy=owner.proxy, trust_env=False, timeout=WAIT) as a_http, \
            httpx.Client(proxy=other.proxy, trust_env=False, timeout=WAIT) as b_http:
        url = world.server.url
        sent = a_http.post(url, json=[legacy, modern], headers=HEADERS)
        assert sent.status_code == 200, sent.text
        answers = {a["id"]: a["result"] for a in sent.json()}
        tasks = [answers[1]["task"]["taskId"], answers[2]["taskId"]]
        assert answers[2]["resultType"] == "task"

        before = list(world.server.calls)
        for task in tasks:
            refused(answer(b_http.post(url, json=rpc("tasks/get", {"taskId": task}, 3), headers=HEADERS)))
            refused(answer(b_http.post(url, json=rpc("tasks/get", {"taskId": task}, 4), headers={
                **HEADERS, "mcp-protocol-version": MODERN, "mcp-method": "tasks/get", "mcp-name": task})))
        assert world.server.calls == before

        polled = a_http.post(url, json=[rpc("tasks/get", {"taskId": t}, 10 + i) for i, t in enumerate(tasks)],
                             headers=HEADERS)
        assert polled.status_code == 200, polled.text
        assert sorted(r["result"]["taskId"] for r in polled.json()) == sorted(tasks)
        # A batch that names one request id twice is refused: its answers could not be told apart.
        twice = a_http.post(url, json=[rpc("tasks/get", {"taskId": tasks[0]}, 7),
                                       rpc("tasks/get", {"taskId": tasks[1]}, 7)], headers=HEADERS)
        assert twice.status_code == 403 and twice.headers["tether-error"] == ABSENT, twice.text
        assert "share the id 7" in twice.json()["error"]["message"], twice.text
    assert [c for c in world.server.calls if c.startswith("tasks/get")][-2:] == [f"tasks/get {t}" for t in tasks]

    reports = wait_until(lambda: len(r := [x for x in world.reports("batch-owner") if x["method"] == "POST"]) >= 3
                         and r, WAIT, what="the owner's reports")
    creating, polls = reports[0], reports[1]
    assert "task of call " + creating["call_id"] in polls["detail"] and polls["capability"] == "next.job", polls
