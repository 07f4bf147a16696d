"""The layers hold: a sidecar process loads nothing of the control plane, and the shared model
(tether/capability/) imports neither side. Checked in fresh interpreters."""

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


def layers(modules: list[str]) -> set[str]:
    """The top-level names loaded: ``tether.proxy.sidecar`` counts as ``proxy``, ``aiohttp.web`` as ``aiohttp``."""
    return {m.split(".")[1] if m.startswith("tether.") and m.count(".") else m.split(".")[0] for m in modules}


def test_a_sidecar_process_loads_no_control_plane_module() -> None:
    """What `tether sidecar` and `tether run` load: the command dispatcher (every command's parser), the shared
    model, the sidecar. Not the control plane's server, stores, commands, or even its client."""
    modules = loaded_after("import tether.cli.main\ntether.cli.main.build_parser()\nimport tether.cli.sidecar, "
                           "tether.cli.run, tether.proxy.sidecar, tether.proxy.credentials, tether.proxy.isolate")
    assert "tether.proxy.sidecar" in modules and "tether.cli.run" in modules  # the check below sees a real sidecar's
    assert "controlplane" not in layers(modules)


def test_building_the_parser_loads_neither_side() -> None:
    """`tether --help` and every command's parser: no mitmproxy, no aiohttp, no control plane."""
    modules = loaded_after("import tether.cli.main\ntether.cli.main.build_parser()")
    assert "tether.cli.main" in modules
    assert layers(modules) & {"controlplane", "proxy", "mitmproxy", "aiohttp"} == set()


@pytest.mark.parametrize("module", ["budget", "catalog", "chain", "credentials", "errors", "glob", "keys", "proof",
                                    "shared", "tracing", "jsonpieces", "report", "events"])
def test_the_shared_model_imports_neither_side(module: str) -> None:
    modules = loaded_after(f"import tether.capability.{module}")
    assert f"tether.capability.{module}" in modules
    assert layers(modules) & {"proxy", "controlplane", "cli"} == set()
