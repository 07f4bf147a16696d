"""The layers hold: a sidecar process loads nothing of the control plane, and the shared model (capability/)
imports neither side. Checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess

import pytest

from .harness import PYTHON


def loaded_after(code: str) -> list[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_sidecar_process_loads_no_control_plane_module() -> None:
    """What `tether sidecar` and `tether run` load: the command dispatcher (every command's parser), the shared
    model, the sidecar. Not the control plane's server, stores, commands, or even its client."""
    modules = loaded_after("import cli.main\ncli.main.build_parser()\n"
                           "import cli.sidecar, cli.run, proxy.sidecar, proxy.credentials, proxy.isolate")
    assert "proxy.sidecar" in modules and "cli.run" in modules  # the check below looks at a real sidecar's modules
    assert [m for m in modules if m.split(".")[0] == "controlplane"] == []


def test_building_the_parser_loads_neither_side() -> None:
    """`tether --help` and every command's parser: no mitmproxy, no aiohttp, no control plane."""
    modules = loaded_after("import cli.main\ncli.main.build_parser()")
    assert [m for m in modules if m.split(".")[0] in ("controlplane", "proxy", "mitmproxy", "aiohttp")] == []


@pytest.mark.parametrize("module", ["budget", "catalog", "chain", "credentials", "errors", "glob", "keys", "proof",
                                    "shared", "tracing", "jsonpieces", "report", "events"])
def test_the_shared_model_imports_neither_side(module: str) -> None:
    modules = loaded_after(f"import capability.{module}")
    assert not [m for m in modules if m.split(".")[0] in ("proxy", "controlplane", "cli")]
