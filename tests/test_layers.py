"""The layers hold: a sidecar process loads nothing of the control plane, and the shared model
(tether/capability/) imports neither side. Checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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


def test_a_control_plane_process_loads_no_sidecar_module(tmp_path: Path) -> None:
    """A control plane built as `tether controlplane serve` builds it (app, routes, services, store, console),
    every one of its modules imported, and the console's HAR download served for real over a capture file:
    nothing of tether.proxy loads. The capture format both sides read lives in tether/capture/."""
    from .harness import CATALOG_TEMPLATE

    (tmp_path / "catalog.yaml").write_text(CATALOG_TEMPLATE.format(http=1, https=2, mcp=3))
    code = f"""
import asyncio, importlib, os, pathlib, pkgutil
root = pathlib.Path({str(tmp_path)!r})
(root / "states" / "a" / "captures").mkdir(parents=True)
from mitmproxy import io as mio
from mitmproxy.test import tflow
with open(root / "states" / "a" / "captures" / "flows.mitm", "wb") as f:
    mio.FlowWriter(f).add(tflow.tflow(resp=True))
os.environ["TETHER_CAPTURES"] = str(root / "states")
import tether.controlplane
for m in pkgutil.walk_packages(tether.controlplane.__path__, "tether.controlplane."):
    importlib.import_module(m.name)
from aiohttp.test_utils import TestClient, TestServer
from tether.cli.controlplane import build
cp = build(f"sqlite:///{{root}}/cp.db", str(root / "catalog.yaml"), str(root / "cp.key"), "t0ken")
async def main():
    async with TestClient(TestServer(cp.app())) as client:
        resp = await client.get("/v1/captures/har?agent=a", headers={{"Authorization": "Bearer t0ken"}})
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["log"]["entries"]) == 1
asyncio.run(main())
"""
    modules = loaded_after(code)
    assert "tether.controlplane.app" in modules and "tether.controlplane.console" in modules
    assert "tether.controlplane.routes.sidecars" in modules and "tether.capture.har" in modules
    assert [m for m in modules if m == "tether.proxy" or m.startswith("tether.proxy.")] == []


@pytest.mark.parametrize("module", ["segments", "retention", "har", "maintenance"])
def test_the_capture_format_imports_neither_side(module: str) -> None:
    modules = loaded_after(f"import tether.capture.{module}")
    assert f"tether.capture.{module}" in modules
    assert layers(modules) & {"proxy", "controlplane", "cli"} == set()
