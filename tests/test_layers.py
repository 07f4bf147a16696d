"""The layers hold: a sidecar process loads nothing of the control plane's server, stores or commands,
and the shared model (capability/) imports neither side. Checked in fresh interpreters."""

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
    """What `tether sidecar` and `tether run` load: the command dispatcher, the shared model, the sidecar."""
    modules = loaded_after("import controlplane.cli as cli\ncli.build_parser()\n"
                           "import proxy.runner, proxy.run, proxy.sidecar")
    ours = [m for m in modules if m.split(".")[0] == "controlplane"]
    outside = [m for m in ours if m not in ("controlplane", "controlplane.cli", "controlplane.client")]
    assert outside == [], outside


@pytest.mark.parametrize("module", ["budget", "catalog", "chain", "credentials", "errors", "glob", "keys", "proof",
                                    "shared", "tracing", "jsonpieces", "report", "events"])
def test_the_shared_model_imports_neither_side(module: str) -> None:
    modules = loaded_after(f"import capability.{module}")
    assert not [m for m in modules if m.split(".")[0] in ("proxy", "controlplane")]
