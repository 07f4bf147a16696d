"""The control plane reads a call report as the sidecar writes it, and a sidecar that may not serve exits quietly.

Issue 23: ``POST /v1/reports`` with a report that had no ``resolution``, or ``"resolution": "banana"``, answered
``200 {"accepted": 1}``; since the first report of a call wins, the sidecar's true report was then dropped as a
duplicate and the record listed the call as ``null`` or ``banana``. Now the whole batch is refused
(``400 tether.bad_request`` naming the field) and nothing of it is stored, on both ways reports come in (the batch
route and a termination's acknowledgement). And a sidecar whose chain is revoked before it serves exits 3 with its
one line, not followed by asyncio's ``Unclosed client session`` dumps.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tether.capability.shared import RESOLUTIONS
from tether.controlplane.client import Signer

from .harness import PYTHON, ControlPlaneProcess, prepare_controlplane, reports_for
from .test_api_hostile import assert_refused, send, signer


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("reports"), 1, 2, 3).start()
    try:
        yield proc
    finally:
        proc.stop()


def registered(cp: ControlPlaneProcess, agent: str) -> Signer:
    ident = cp.issue(agent, {"issues.read": "direct"})
    s = signer(ident)
    assert send(cp, "POST", "/v1/chains/register", json.dumps({"chain": ident.wire}).encode(), sign=s)[0] == 200
    return s


def report(call_id: str, **fields: Any) -> dict[str, Any]:
    return {"call_id": call_id, "capability": "issues.read", "tier": "direct", "method": "GET",
            "url": "http://127.0.0.1:1/repos/o/r/issues", "started_at": time.time() - 1, "resolution": "completed",
            "status": 200, "ended_at": time.time(), **fields}


def post(cp: ControlPlaneProcess, s: Signer, path: str, doc: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    return send(cp, "POST", path, json.dumps(doc).encode(), sign=s)


BAD = [
    ("no resolution", {"resolution": None}, "resolution", "needs 'resolution'"),
    ("resolution banana", {"resolution": "banana"}, "resolution", "not 'banana'"),
    ("resolution of another type", {"resolution": 7}, "resolution", "must be a string"),
    ("tier banana", {"tier": "banana"}, "tier", "'tier' must be one of"),
    ("status out of range", {"status": 1000}, "status", "HTTP status"),
    ("status of another type", {"status": "200"}, "status", "must be an integer"),
    ("started_at of another type", {"started_at": "yesterday"}, "started_at", "must be a number"),
    ("ended_at no float can hold", {"ended_at": 10**400}, "ended_at", "must be a finite number"),
]


@pytest.mark.parametrize(("what", "change", "field", "fragment"), BAD, ids=[b[0] for b in BAD])
def test_a_batch_with_one_bad_report_is_refused_whole_and_the_true_report_then_counts(
        cp: ControlPlaneProcess, what: str, change: dict[str, Any], field: str, fragment: str) -> None:
    agent = "rep-" + what.replace(" ", "-")
    s = registered(cp, agent)
    good, bad = report(f"{agent}-good"), report(f"{agent}-target", **change)
    status, _, doc = post(cp, s, "/v1/reports", {"reports": [good, bad]})
    assert_refused((status, _, doc), 400, "tether.bad_request", "reports[1]", fragment)
    assert doc["error"]["field"] == field, doc
    assert reports_for(cp, agent) == []  # nothing of the batch is stored, the good report neither

    # The sidecar's true report of that call is then accepted, not dropped as a duplicate of the forged one.
    status, _, doc = post(cp, s, "/v1/reports", {"reports": [good, report(f"{agent}-target")]})
    assert status == 200 and doc == {"accepted": 2, "duplicates": 0}, doc
    stored = {r["call_id"]: r for r in reports_for(cp, agent)}
    assert stored[f"{agent}-target"]["resolution"] == "completed" and stored[f"{agent}-target"]["status"] == 200


def test_every_documented_resolution_is_accepted(cp: ControlPlaneProcess) -> None:
    s = registered(cp, "rep-every")
    batch = [report(f"rep-every-{r}", resolution=r, status=None if r != "completed" else 200) for r in RESOLUTIONS]
    status, _, doc = post(cp, s, "/v1/reports", {"reports": batch})
    assert status == 200 and doc["accepted"] == len(RESOLUTIONS), doc
    assert sorted(r["resolution"] for r in reports_for(cp, "rep-every")) == sorted(RESOLUTIONS)


def test_a_start_that_names_a_resolution_is_refused(cp: ControlPlaneProcess) -> None:
    s = registered(cp, "rep-start")
    start = {"event": "start", "call_id": "rep-start-1", "capability": "issues.read", "method": "GET",
             "url": "http://127.0.0.1:1/x", "started_at": time.time()}
    status, _, doc = post(cp, s, "/v1/reports", {"reports": [], "starts": [{**start, "resolution": "completed"}]})
    assert_refused((status, _, doc), 400, "tether.bad_request", "starts[0]", "a start has no 'resolution'")
    assert doc["error"]["field"] == "resolution"
    status, _, doc = post(cp, s, "/v1/reports", {"reports": [], "starts": [start]})
    assert status == 200, doc


def test_an_acknowledgement_with_a_bad_report_is_refused_and_stores_nothing(cp: ControlPlaneProcess) -> None:
    """The other way reports come in: a termination's acknowledgement (``POST /v1/sidecars/quiesced``)."""
    s = registered(cp, "rep-ack")
    tid = cp.client().request("POST", "/v1/agents/rep-ack/terminate", {"mode": "abort", "window_s": 1})["id"]
    ack = {"termination_id": tid, "reports": [report("rep-ack-1", resolution="banana")], "starts": [],
           "calls": {}, "state": "terminated"}
    status, _, doc = post(cp, s, "/v1/sidecars/quiesced", ack)
    assert_refused((status, _, doc), 400, "tether.bad_request", "reports[0]", "not 'banana'")
    assert reports_for(cp, "rep-ack") == []
    status, _, doc = post(cp, s, "/v1/sidecars/quiesced", {**ack, "reports": [report("rep-ack-1")]})
    assert status == 200, doc
    (stored,) = reports_for(cp, "rep-ack")
    assert stored["resolution"] == "completed"


def test_the_openapi_document_says_what_a_report_must_name(cp: ControlPlaneProcess) -> None:
    spec = send(cp, "GET", "/openapi.json")[2]
    body = spec["paths"]["/v1/reports"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    final = body["properties"]["reports"]
    items = (final.get("items") or next(s["items"] for s in final["anyOf"] if "items" in s))
    assert "resolution" in items["required"] and items["properties"]["resolution"]["enum"] == list(RESOLUTIONS)


def test_a_sidecar_on_a_revoked_chain_exits_3_with_one_line_and_no_asyncio_dumps(
        cp: ControlPlaneProcess) -> None:
    ident = cp.issue("rep-revoked", {"issues.read": "direct"})
    cp.client().request("POST", "/v1/chains/register", {"chain": ident.wire})
    cp.client().request("POST", f"/v1/grants/{ident.jti}/revoke", {"reason": "test"})
    state_dir = cp.directory / "sidecars" / "rep-revoked"
    args = [PYTHON, "-m", "tether", "sidecar", "--controlplane", cp.url, "--chain", str(ident.chain_path),
            "--key", str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir", str(state_dir)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**cp.env(), "PYTHONASYNCIODEBUG": ""})
    assert done.returncode == 3, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("tether: rep-revoked will not serve:") and "revoked" in lines[0], done.stderr
    assert "Unclosed" not in done.stderr and done.stdout == ""
