"""A sidecar SIGTERMed while calls arrive (every pod stop, every rolling update): it stops admitting, lets what
left finish within its stop window, cuts the rest, and only then reports and says goodbye. The tool server's
log is the ground truth: every call it received is reported as having left, and no call reported as never
sent reached it."""

from __future__ import annotations

import signal
import threading
import time
from urllib.parse import urlsplit

import requests

from .conftest import World
from .harness import reports_for, wait_until

THREADS = 16
NOT_SENT = ("refused", "failed_not_sent", "cancelled_not_sent")


def test_sigterm_while_sixteen_threads_call_keeps_the_record_true(world: World) -> None:
    ident = world.cp.issue("stop-a", {"issues.read": "direct"})
    sc = world.sidecar(ident, "--stop-window", "1", "--no-capture")
    assert sc.proc is not None
    answered: dict[str, int] = {}  # path -> status the agent got
    halt = threading.Event()

    def caller(t: int) -> None:
        n = 0
        while not halt.is_set():
            n += 1
            # Quick calls, and from four threads a first one that outlasts the 1 s stop window (it is cut).
            delay = 20.0 if (t < 4 and n == 1) else 0.02 * (n % 5)
            path = f"/repos/stop/{t}-{n}/issues"
            try:
                resp = requests.get(f"{world.tools.base}{path}?delay={delay}", proxies=sc.proxies(), timeout=30)
                answered[path] = resp.status_code
            except requests.RequestException:
                if sc.proc is not None and sc.proc.poll() is not None:
                    return
                time.sleep(0.01)

    threads = [threading.Thread(target=caller, args=(t,), daemon=True) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(answered) >= 40, 60, what="calls flowing before the stop")
    sc.proc.send_signal(signal.SIGTERM)
    assert sc.proc.wait(timeout=60) == 0, sc.log_text[-2000:]
    halt.set()
    for thread in threads:
        thread.join(timeout=40)
    time.sleep(0.5)  # anything the sidecar wrote before it exited has reached the tool by now

    received = {path for _, path in world.tools.hits if path.startswith("/repos/stop/")}
    reports = {urlsplit(r["url"]).path: r for r in reports_for(world.cp, "stop-a")}
    assert len(reports) == len(reports_for(world.cp, "stop-a")), "a call reported twice"
    missing = received - reports.keys()
    assert not missing, f"{len(missing)} call(s) the tool received are not reported: {sorted(missing)[:5]}"
    lied = sorted(p for p in received if reports[p]["resolution"] in NOT_SENT)
    assert not lied, f"reported as never sent, yet the tool received them: {lied[:5]}"
    for path, report in reports.items():
        if report["resolution"] in NOT_SENT:
            assert path not in received
        else:
            assert report["resolution"] in ("completed", "unknown"), report
    for path, status in answered.items():  # what the agent was told matches the record
        if status == 200:
            assert reports[path]["resolution"] == "completed", (path, reports[path])
        elif status == 503:
            assert reports[path]["resolution"] in NOT_SENT, (path, reports[path])
    long_calls = [reports[f"/repos/stop/{t}-1/issues"] for t in range(4)]
    assert all(r["resolution"] == "unknown" for r in long_calls), long_calls  # left, cut, no answer
    assert any(r["resolution"] == "completed" for r in reports.values())
    assert any(r.get("code") == "tether.stopping" for r in reports.values())  # admitted nothing new meanwhile
    assert "cutting 4 call(s)" in sc.log_text
