"""The official MCP conformance suite's server scenarios, directly and through a real tether sidecar.

Two real servers from npm, on 127.0.0.1: the suite's own reference server (every scenario passes against it)
and ``@modelcontextprotocol/server-everything``. For each, the runner (``@modelcontextprotocol/conformance``
on Node 22) runs every server scenario directly, then through a real ``tether sidecar`` whose chain holds
(``direct``) every item the server offers that the catalog can name (tools, resources and templates, prompts,
logging, completion, subscriptions), under a real control plane, following ``HTTP_PROXY`` with
``NODE_USE_ENV_PROXY=1``. Every scenario that passes directly must pass through tether.

Known today (``REFUSED_TODAY``): tether answers its refusal of a ``Host`` that does not name the destination
with HTTP 200 and a JSON-RPC error, where the DNS-rebinding probe expects a 4xx; and server-everything accepts a
subscription to a resource it does not offer, which tether refuses as absent. Those scenarios are
``xfail(strict=True, raises=RefusedByTether)``: expected only while tether's own refusal is what fails them,
failures as soon as they pass (remove the entry then) or fail for any other reason.

Skipped, with the reason printed, where the npm packages cannot be installed. The kit is installed once into
``$TETHER_CONFORMANCE_CACHE`` (default ``.cache/conformance``); see docs/conformance.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from . import mcp_conformance as kit

# What `conformance list --server` prints for the pinned runner (0.1.16), in its order.
SCENARIOS = (
    "server-initialize", "logging-set-level", "ping", "completion-complete", "tools-list",
    "tools-call-simple-text", "tools-call-image", "tools-call-audio", "tools-call-embedded-resource",
    "tools-call-mixed-content", "tools-call-with-logging", "tools-call-error", "tools-call-with-progress",
    "tools-call-sampling", "tools-call-elicitation", "json-schema-2020-12", "elicitation-sep1034-defaults",
    "server-sse-polling", "server-sse-multiple-streams", "elicitation-sep1330-enums", "resources-list",
    "resources-read-text", "resources-read-binary", "resources-templates-read", "resources-subscribe",
    "resources-unsubscribe", "prompts-list", "prompts-get-simple", "prompts-get-with-args",
    "prompts-get-embedded-resource", "prompts-get-with-image", "dns-rebinding-protection",
)

# Directly, server-everything passes these only (it has none of the suite's test_* tools, resources or prompts;
# tools-call-simple-text and tools-call-error pass on its "Tool ... not found" error result).
DIRECT_PASSES = {
    "reference": frozenset(SCENARIOS),
    "everything": frozenset({
        "server-initialize", "logging-set-level", "ping", "tools-list", "tools-call-simple-text",
        "tools-call-error", "server-sse-multiple-streams", "resources-list", "resources-subscribe",
        "resources-unsubscribe", "prompts-list"}),
}

SUBSCRIBE_ABSENT = ("the scenario subscribes to test://watched-resource, which server-everything does not offer (it "
                    "accepts the subscription anyway, so the scenario passes directly): no grant names it, so "
                    "tether refuses it as absent. By design: remove only if the scenario changes")

# Scenario -> (what each failed check must show: tether's refusal, why it fails through tether today).
# Remove an entry when its scenario passes.
REFUSED_TODAY = {
    "reference": {},
    "everything": {
        "resources-subscribe": ("MCP error -32003: resource 'test://watched-resource' is not granted",
                                SUBSCRIBE_ABSENT),
        "resources-unsubscribe": ("MCP error -32003: resource 'test://watched-resource' is not granted",
                                  SUBSCRIBE_ABSENT),
    },
}


class RefusedByTether(AssertionError):
    """The scenario failed through tether, and every failed check shows the refusal ``REFUSED_TODAY`` names."""


@dataclass
class Comparison:
    kind: str
    url: str
    direct: kit.SuiteRun
    sidecar: kit.SuiteRun
    capabilities: dict[str, str]  # capability -> the item it grants
    reports: list[dict[str, Any]]


class Suites:
    """Runs each server's comparison once per module, on first use, and keeps no process running after it."""

    def __init__(self, chain: kit.Toolchain, directory: Path) -> None:
        self.chain = chain
        self.directory = directory
        self._done: dict[str, Comparison | Exception] = {}

    def __getitem__(self, kind: str) -> Comparison:
        if kind not in self._done:
            try:
                self._done[kind] = self._compare(kind)
            except Exception as exc:  # every test of this server reports the one failed setup, none re-runs it
                self._done[kind] = exc
        done = self._done[kind]
        if isinstance(done, Exception):
            raise AssertionError(f"the {kind} comparison could not run: {done!r}") from done
        return done

    def _compare(self, kind: str) -> Comparison:
        where = self.directory / kind
        server = kit.start_server(self.chain, kind, where)
        try:
            direct = kit.run_suite(self.chain, server.url, where / "direct")
            tethered = kit.start_tether(where / "tether", server.url, kit.list_items(server.url))
            try:
                sidecar = kit.run_suite(self.chain, server.url, where / "sidecar", proxy=tethered.proxy)
                reports = _reports(tethered)
            finally:
                tethered.stop()
        finally:
            server.stop()
        return Comparison(kind, server.url, direct, sidecar, tethered.capabilities, reports)


def _sessions(reports: list[dict[str, Any]]) -> int:
    return sum(1 for r in reports if r["resolution"] == "completed" and r.get("detail") == "mcp initialize")


def _reports(tethered: kit.Tethered, timeout: float = 20) -> list[dict[str, Any]]:
    """The sidecar's reports once every scenario's session is in (they arrive in batches), or what is in by
    ``timeout``: the tests say what is missing."""
    deadline = time.monotonic() + timeout
    while True:
        reports = kit.tethered_calls(tethered)
        if _sessions(reports) >= len(SCENARIOS) or time.monotonic() > deadline:
            return reports
        time.sleep(0.25)


@pytest.fixture(scope="module")
def suites(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suites]:
    try:
        chain = kit.install()
    except kit.KitUnavailable as exc:
        reason = f"MCP conformance suite not run: {exc}"
        _say(request.config, f"{request.node.nodeid}: {reason}")
        pytest.skip(reason)
    yield Suites(chain, tmp_path_factory.mktemp("conformance"))


def _say(config: pytest.Config, line: str) -> None:
    """Print past output capture (a skip's reason is otherwise shown only under -rs)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"\n{line}")


def test_the_runner_has_the_pinned_scenarios(suites: Suites) -> None:
    assert kit.server_scenarios(suites.chain) == list(SCENARIOS)


@pytest.mark.parametrize("kind", kit.SERVERS)
def test_direct_results_are_the_known_ones(suites: Suites, kind: str) -> None:
    """The baseline the comparison stands on: the runner reported every scenario, and exactly the known
    ones pass with no proxy in the way."""
    direct = suites[kind].direct
    assert set(direct.scenarios) == set(SCENARIOS), direct.log_path.read_text()[-3000:]
    passing = {name for name, scenario in direct.scenarios.items() if scenario.passed}
    assert passing == DIRECT_PASSES[kind], {name: direct.scenarios[name].failures
                                            for name in passing ^ DIRECT_PASSES[kind]}


@pytest.mark.parametrize("kind", kit.SERVERS)
def test_the_runner_went_through_the_sidecar(suites: Suites, kind: str) -> None:
    """Node ignores HTTP_PROXY unless told: without this, a 'pass through tether' could be a direct run. Every
    scenario's session, every tool call and every refusal is in the sidecar's reports, all for this server."""
    run = suites[kind]
    assert set(run.sidecar.scenarios) == set(SCENARIOS), run.sidecar.log_path.read_text()[-3000:]
    assert _sessions(run.reports) >= len(SCENARIOS)
    assert {r["url"] for r in run.reports} == {run.url}
    completed_items = {r["capability"] for r in run.reports if r["resolution"] == "completed" and r["capability"]}
    assert completed_items <= set(run.capabilities)
    if kind == "reference":  # server-everything has none of the tools the scenarios call
        assert completed_items, "no tools/call reached the reference server through the sidecar"
    refused = [r for r in run.reports if r["resolution"] == "refused"]
    assert len(refused) >= len(REFUSED_TODAY[kind]), (
        f"{len(refused)} refusals, {len(REFUSED_TODAY[kind])} scenarios in REFUSED_TODAY: remove those that pass now")


def _through_tether_cases() -> list[Any]:
    cases = []
    for kind in kit.SERVERS:
        for name in SCENARIOS:
            if name not in DIRECT_PASSES[kind]:
                continue
            marks = []
            if name in REFUSED_TODAY[kind]:
                reason = REFUSED_TODAY[kind][name][1]
                marks.append(pytest.mark.xfail(strict=True, raises=RefusedByTether, reason=reason))
            cases.append(pytest.param(kind, name, marks=marks, id=f"{kind}-{name}"))
    return cases


@pytest.mark.parametrize(("kind", "scenario"), _through_tether_cases())
def test_a_scenario_that_passes_directly_passes_through_tether(suites: Suites, kind: str, scenario: str) -> None:
    run = suites[kind]
    assert run.direct.scenarios[scenario].passed, run.direct.scenarios[scenario].failures
    through = run.sidecar.scenarios.get(scenario)
    assert through is not None, f"the runner reported nothing for {scenario}: {run.sidecar.log_path}"
    if through.passed:
        return
    mark = REFUSED_TODAY[kind].get(scenario, ("", ""))[0]
    if mark and through.failures and all(mark in failure for failure in through.failures):
        raise RefusedByTether(f"{scenario} through tether: {through.failures}")
    raise AssertionError(f"{scenario} passes directly, fails through tether: {through.failures}")
