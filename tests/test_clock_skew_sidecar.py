"""A sidecar whose own clock is off does not shorten its drain (issue 29, item 4).

The control plane hands out every drain command with ``remaining_s``, the window left as its clock saw it when it
handed the command out; the sidecar counts that down on its monotonic clock. Before, it took the command's absolute
deadline against its own wall clock, so a sidecar 4 s ahead (within the proofs' 5 s leeway, so it still talks to the
control plane) cut a 6 s drain to 2 s and aborted a 3.5 s call that was meant to finish. Real processes: a control
plane with the machine's clock, a sidecar under libfaketime, the harness's tool server (``/slow``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from .conftest import World
from .harness import PYTHON, wait_until
from .test_clock_skew import faketime_env

FAKETIME = shutil.which("faketime")
AHEAD = "+4s"  # inside the 5 s leeway a proof may be dated ahead
WINDOW_S = 6.0
CALL_S = 3.5


def test_a_sidecar_with_its_clock_ahead_keeps_the_whole_drain_window(world: World, tmp_path: Path) -> None:
    if FAKETIME is None:
        print("SKIP test_clock_skew_sidecar: faketime is not installed (apt-get install faketime)")
        pytest.skip("faketime is not installed")
    ident = world.cp.issue("ahead", {"slow.read": "direct"})
    state = tmp_path / "ahead"
    state.mkdir()
    ready = state / "ready.json"
    with open(state / "sidecar.log", "wb") as log:
        proc = subprocess.Popen([PYTHON, "-m", "tether", "sidecar", "--controlplane",
                                 world.cp.url, "--chain", str(ident.chain_path), "--key", str(ident.key_path),
                                 "--listen", "127.0.0.1:0", "--state-dir", str(state), "--ready-file", str(ready)],
                                stdout=log, stderr=log, env={**world.cp.env(), **faketime_env(AHEAD)})
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60, what="the sidecar 4 s ahead")
        assert ready.exists(), (state / "sidecar.log").read_text()[-2000:]
        proxy = json.loads(ready.read_text())["proxy"]
        result: dict[str, Any] = {}

        def slow_call() -> None:
            try:
                resp = requests.get(f"{world.tools.base}/slow?s={CALL_S}", proxies={"http": proxy}, timeout=60)
                result["status"] = resp.status_code
            except requests.RequestException as exc:
                result["status"] = f"error {type(exc).__name__}"

        thread = threading.Thread(target=slow_call)
        thread.start()
        wait_until(lambda: world.tools.active > 0, 20, what="the slow call at the tool")
        doc = world.cp.client().request("POST", "/v1/agents/ahead/terminate",
                                        {"mode": "drain", "window_s": WINDOW_S, "reason": "test"})
        thread.join(60)
        assert result.get("status") == 200, result  # it finished inside the window: not cut

        def record() -> dict[str, Any] | None:
            t = world.cp.client().request("GET", f"/v1/terminations/{doc['id']}")
            return t if t["state"] == "terminated" else None

        wait_until(record, 60, what="the termination record")
        rec = world.cp.client().request("GET", f"/v1/records/{doc['id']}")
        [call] = [c for c in rec["calls"] if "/slow" in c.get("url", "")]
        assert call["resolution"] == "completed", call
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
