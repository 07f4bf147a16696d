"""Sidecar flags a platform team sets: --no-capture, --call-timeout, --trust (a pinned control plane key)."""

from __future__ import annotations

import pytest
import requests

from tether.capability import keys

from .conftest import World
from .harness import SidecarProcess, reports_for, wait_until


def test_no_capture_forwards_tracks_and_reports_without_writing_flows(world: World) -> None:
    ident = world.cp.issue("nocap", {"issues.read": "direct"})
    sc = world.sidecar(ident, "--no-capture")
    assert requests.get(f"{world.tools.base}/repos/o/r/issues", proxies=sc.proxies(), timeout=10).status_code == 200
    refused = requests.post(f"{world.tools.base}/repos/o/r/issues", json={}, proxies=sc.proxies(), timeout=10)
    assert refused.headers["Tether-Error"] == "tether.capability_absent"
    reports = wait_until(lambda: len(reports_for(world.cp, "nocap")) == 2 and reports_for(world.cp, "nocap"),
                         what="both reports")
    assert sorted(r["resolution"] for r in reports) == ["completed", "refused"]
    assert all(r["capture_ref"] is None for r in reports)
    assert not (sc.state_dir / "captures").exists()


def test_call_timeout_cuts_a_hanging_call_as_unknown(world: World) -> None:
    ident = world.cp.issue("impatient", {"hang.read": "direct", "issues.read": "direct"})
    sc = world.sidecar(ident, "--call-timeout", "2")
    with pytest.raises(requests.exceptions.RequestException):
        requests.get(f"{world.tools.base}/hang", proxies=sc.proxies(), timeout=30)
    report = wait_until(lambda: [r for r in reports_for(world.cp, "impatient") if r["url"].endswith("/hang")],
                        20, what="the hanging call's report")[0]
    assert (report["resolution"], report["code"]) == ("unknown", "tether.aborted")
    assert world.tools.hits_for("/hang") == 1  # cut, never retried
    assert requests.get(f"{world.tools.base}/repos/o/r/issues", proxies=sc.proxies(), timeout=10).status_code == 200


def test_a_pinned_trust_key_refuses_a_chain_from_another_control_plane(world: World) -> None:
    ident = world.cp.issue("pinned", {"issues.read": "direct"})
    right = f"{world.cp.signing_key_path}.pub"
    sc = world.sidecar(ident, "--trust", right)
    assert requests.get(f"{world.tools.base}/repos/o/r/issues", proxies=sc.proxies(), timeout=10).status_code == 200
    sc.stop()
    wrong = world.cp.directory / "other.pub"
    wrong.write_bytes(keys.public_pem(keys.generate().public_key()))
    impostor = SidecarProcess(world.cp, ident, ["--trust", str(wrong)])
    with pytest.raises(AssertionError, match="sidecar exited"):
        impostor.start(world.ca.ca_pem)
    assert "tether.chain_invalid" in impostor.log_text and "does not verify" in impostor.log_text
