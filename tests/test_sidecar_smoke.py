"""The thin path end to end: grant -> sidecar -> tool -> report."""

from __future__ import annotations

import requests

from .conftest import World
from .harness import reports_for, wait_until


def test_granted_call_forwarded_and_reported_ungranted_refused(world: World) -> None:
    ident = world.cp.issue("agent-a", {"issues.read": "direct"})
    sc = world.sidecar(ident)
    ok = requests.get(f"{world.tools.base}/repos/o/r/issues", proxies=sc.proxies(), timeout=10)
    assert ok.status_code == 200 and ok.json()["repo"] == "r"
    refused = requests.post(f"{world.tools.base}/repos/o/r/issues", json={"t": 1}, proxies=sc.proxies(), timeout=10)
    assert refused.status_code == 403
    assert refused.headers["Tether-Error"] == "tether.capability_absent"
    assert refused.json()["error"]["code"] == "tether.capability_absent"
    assert world.tools.hits == [("GET", "/repos/o/r/issues")]
    reports = wait_until(lambda: len(reports_for(world.cp, "agent-a")) == 2 and reports_for(world.cp, "agent-a"),
                         what="two reports")
    assert sorted(r["resolution"] for r in reports) == ["completed", "refused"]


def test_https_through_the_sidecar_ca(world: World) -> None:
    ident = world.cp.issue("agent-s", {"secure.issues": "direct"})
    sc = world.sidecar(ident)
    resp = requests.get(f"https://localhost:{world.secure.port}/repos/o/r/issues", proxies=sc.proxies(),
                        verify=sc.ca, timeout=10)
    assert resp.status_code == 200
    assert world.secure.hits == [("GET", "/repos/o/r/issues")]
