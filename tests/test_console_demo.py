"""`tether demo --console`: every decision of the demo made by a person in the browser (Debian's chromium,
driven by Playwright): the held call approved, writer's branch revoked, the root terminated with a drain;
the demo then shows the record it got and stops everything on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from tether.controlplane.termination import terminated_agents

from .harness import PYTHON, wait_until
from .test_console import browser, nav  # noqa: F401  (the browser fixture: Debian's chromium)

CONSOLE_LINE = re.compile(r"console (http://127\.0\.0\.1:\d+)/ui/\s+admin token (\S+)")


class Output:
    """The demo's stdout, read as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.text += line

    def wait_for(self, needle: str, timeout: float = 120) -> str:
        wait_until(lambda: needle in self.text, timeout, interval=0.2, what=f"the demo to say {needle!r}")
        return self.text


def test_every_decision_of_the_demo_from_the_browser(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    from playwright.sync_api import expect

    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    demo = subprocess.Popen([PYTHON, "-m", "tether", "demo", "--console", "--fast", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = Output(demo)
    try:
        match = wait_until(lambda: CONSOLE_LINE.search(out.text), 90, what="the console URL and token")
        url, token = match.group(1), match.group(2)
        page = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
        page.goto(f"{url}/ui/")
        page.get_by_label("Admin token").fill(token)
        page.get_by_role("button", name="Sign in").click()

        out.wait_for("Approve or deny it in the console")
        nav(page, "Approvals")
        card = page.locator("article.approval").filter(has_text="root").first
        expect(card.locator("pre.request")).to_contain_text("summarize incident 4711")
        card.get_by_role("button", name="Approve this call").click()

        out.wait_for("Revoke writer in the console")
        nav(page, "Agents")
        page.get_by_role("button", name="Revoke writer").first.click()
        page.get_by_role("dialog").get_by_role("button", name="Revoke writer").click()

        out.wait_for("Terminate root in the console")
        page.get_by_role("button", name="Terminate root").first.click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_label("Mode").select_option("drain")
        dialog.get_by_label("Window (seconds)").fill("4")
        dialog.get_by_label("Reason").fill("stopped from the console")
        dialog.get_by_role("button", name=re.compile(r"Terminate \d+ agent")).click()

        out.wait_for("The console stays up", timeout=90)
        nav(page, "Terminations")
        row = page.locator("tr", has_text="root").filter(has=page.locator(".termination-state"))
        expect(row.locator(".termination-state").first).to_have_text("terminated")
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(60)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
    text = out.text
    assert demo.returncode == 0, text[-3000:]
    assert "tether.chain_revoked" in text and "nothing is left running" in text
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["reason"] == "stopped from the console" and record["mode"] == "drain"
    assert sorted(terminated_agents(record)) == ["researcher", "root", "summarizer", "writer"]
    assert record["agents_unaccounted"] == []
