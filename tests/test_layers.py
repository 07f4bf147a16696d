"""The layers hold: a sidecar process loads nothing of the control plane, and the shared model
(tether/capability/) imports neither side. Checked in fresh interpreters."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from .harness import PYTHON

CONTROLPLANE = Path(__file__).resolve().parent.parent / "tether" / "controlplane"


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
                                    "shared", "tracing", "jsonpieces", "report", "events", "kinds",
                                    "decision", "mcpwire", "protocol"])
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


# -- routes and the console reach the store only through the services ----------------------------------------
# What a route module may import from the store package: the errors it turns into 503s, nothing that reads.
STORE_ERRORS = {"STORE_UNWRITABLE", "StoreUnavailable", "StoreUnwritable", "LinkConflict", "Doc"}


def store_reaches(source: str, package: str) -> list[str]:
    """Where a module of ``package`` (dotted, e.g. ``tether.controlplane.routes``) reaches the store past the
    services: an attribute named ``store`` or ``_store`` read anywhere (``self.store``, ``cp.store``,
    ``self.events.store``), or an import from the store package of anything but its error names (the ``Store``
    class, a backend module). Each finding is ``line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("store", "_store"):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(package, node.module, node.level)
            if base == "tether.controlplane.store" or base.startswith("tether.controlplane.store."):
                names = {alias.name for alias in node.names}
                if base != "tether.controlplane.store" or names - STORE_ERRORS:
                    found.append(f"{node.lineno}: from {base} import {', '.join(sorted(names))}")
            elif base == "tether.controlplane" and {a.name for a in node.names} & {"store"}:
                found.append(f"{node.lineno}: from {base} import store")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("tether.controlplane.store")]
    return found


def _absolute(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


@pytest.mark.parametrize("folder", ["routes", "console"])
def test_routes_and_the_console_touch_the_store_only_through_services(folder: str) -> None:
    """Every store read and write from a route or the console page goes through a service method: a route
    parses, calls a service, answers (docs/architecture.md, "routes over services over a store")."""
    files = sorted((CONTROLPLANE / folder).rglob("*.py"))
    assert len(files) >= 4  # the check below read the real modules
    found = {str(f.relative_to(CONTROLPLANE)): store_reaches(f.read_text(), f"tether.controlplane.{folder}")
             for f in files}
    assert {name: where for name, where in found.items() if where} == {}


def test_the_store_check_finds_a_route_reaching_past_the_services() -> None:
    """The check above is not vacuous: each way past the services it looks for is found."""
    package = "tether.controlplane.routes"
    assert store_reaches("async def h(self):\n    return await self.store.reports(None)\n", package) == [
        "2: .store"]
    assert store_reaches("x = cp.events.store\n", package) == ["1: .store"]
    assert store_reaches("from ..store import Store\n", package) == ["1: from tether.controlplane.store import Store"]
    assert store_reaches("from ..store.sqlite import SqliteStore\n", package) != []
    assert store_reaches("import tether.controlplane.store.redis\n", package) != []
    assert store_reaches("from ..store import StoreUnavailable\nfrom ..services.records import RecordService\n",
                         package) == []


# -- document kinds: constants in services/kinds.py, each written only by its owner ----------------------------
DOC_READS, DOC_WRITES = {"get_doc", "list_docs"}, {"put_doc", "cas_doc"}


def kind_uses(source: str, module: str) -> tuple[list[str], list[tuple[str, str]]]:
    """A module's store document calls: the findings (``line: what``: a kind spelled as a bare string or any
    way but ``kinds.NAME``, a name ``services/kinds.py`` does not define, a write by a module that does not own
    the kind) and the (kind, call) pairs it makes. ``module``: its name under ``tether/controlplane/``, e.g.
    ``services/grants``."""
    from tether.controlplane.services import kinds

    found: list[str] = []
    uses: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in DOC_READS | DOC_WRITES and node.args):
            continue
        call, first = node.func.attr, node.args[0]
        if not (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name) and first.value.id == "kinds"):
            found.append(f"{node.lineno}: {call}({ast.unparse(first)}): name the kind as kinds.NAME")
            continue
        kind = getattr(kinds, first.attr, None)
        if kind not in kinds.OWNERS:
            found.append(f"{node.lineno}: {call}(kinds.{first.attr}): not a kind in services/kinds.py")
            continue
        uses.append((kind, call))
        if call in DOC_WRITES and module != f"services/{kinds.OWNERS[kind]}":
            found.append(f"{node.lineno}: {call}(kinds.{first.attr}) outside its owner "
                         f"services/{kinds.OWNERS[kind]}.py")
    return found, uses


def test_document_kinds_are_constants_each_written_only_by_its_owner() -> None:
    """Every store document call in the control plane names its kind by a constant of services/kinds.py, and
    only the kind's owner writes it (other services read it by the same constant); every kind is written by
    its owner (the table of owners is true)."""
    from tether.controlplane.services import kinds

    files = [f for f in sorted(CONTROLPLANE.rglob("*.py")) if "store" not in f.relative_to(CONTROLPLANE).parts]
    findings: dict[str, list[str]] = {}
    written: set[tuple[str, str]] = set()
    for f in files:
        module = str(f.relative_to(CONTROLPLANE).with_suffix(""))
        found, uses = kind_uses(f.read_text(), module)
        if found:
            findings[module] = found
        written |= {(kind, module) for kind, call in uses if call in DOC_WRITES}
    assert findings == {}
    assert written == {(kind, f"services/{owner}") for kind, owner in kinds.OWNERS.items()}
    spelled = {v for k, v in vars(kinds).items() if k.isupper() and isinstance(v, str)}
    assert spelled == set(kinds.OWNERS)  # every constant has its owner, and no two kinds share a spelling


def test_the_kind_check_finds_a_bare_kind_and_a_write_past_its_owner() -> None:
    """The check above is not vacuous: a bare string, a name not from kinds, an unknown constant and a write by
    another service are each found; a read by another service through the constant is not."""
    def found(source: str, module: str = "services/events") -> list[str]:
        return kind_uses(source, module)[0]

    assert found('store.get_doc("approval", i)') == ['1: get_doc(\'approval\'): name the kind as kinds.NAME']
    assert found("store.list_docs(APPROVAL)") == ["1: list_docs(APPROVAL): name the kind as kinds.NAME"]
    assert found("store.list_docs(kinds.NOTHING)") == ["1: list_docs(kinds.NOTHING): not a kind in services/kinds.py"]
    assert found("store.put_doc(kinds.APPROVAL, i, d)") == [
        "1: put_doc(kinds.APPROVAL) outside its owner services/approvals.py"]
    assert found("store.cas_doc(kinds.APPROVAL, i, 0, d)", "services/approvals") == []
    assert found("store.get_doc(kinds.COMMAND, link)") == []


STORE = CONTROLPLANE / "store"
MAX_CLASS_LINES = 300


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """Every class (nested ones too) longer than ``limit`` lines, from its ``class`` line to its last."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def test_no_store_class_passes_300_lines() -> None:
    """The store backends are split by concern (one mixin per module beside the backend), so none is a
    monolith again: every class under tether/controlplane/store/ stays within 300 lines."""
    files = sorted(STORE.rglob("*.py"))
    assert {f.name for f in files} >= {"sqlite.py", "redis.py", "base.py"}
    too_long = {str(f.relative_to(STORE)): long for f in files if (long := long_classes(f.read_text()))}
    assert too_long == {}


def test_the_class_length_check_finds_a_long_class() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    assert long_classes(f"class Big:\n{body}") == [("Big", MAX_CLASS_LINES + 1)]
    assert long_classes(f"class Fits:\n{body[:body.rindex('    x')]}") == []
