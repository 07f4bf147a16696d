"""Shared fixtures: a world of real parts (tool servers, MCP server, control plane process) per test."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .harness import (
    ControlPlaneProcess,
    Identity,
    McpServer,
    RedisServer,
    SidecarProcess,
    TestCA,
    ToolServer,
    free_port,
    make_test_ca,
    prepare_controlplane,
)


@dataclass
class World:
    directory: Path
    tools: ToolServer
    secure: ToolServer
    mcp: McpServer
    ca: TestCA
    cp: ControlPlaneProcess
    sidecars: list[SidecarProcess] = field(default_factory=list)

    def sidecar(self, identity: Identity, *extra: str, upstream_ca: bool = True) -> SidecarProcess:
        sidecar = SidecarProcess(self.cp, identity, list(extra))
        self.sidecars.append(sidecar)
        return sidecar.start(self.ca.ca_pem if upstream_ca else None)


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store's URL, once for each kind: a SQLite file in the test's directory, a redis-server of its own
    (test modules with a store fixture of their own, or a parametrized `store`, override it)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tether.db'}"
        return
    redis = RedisServer(tmp_path / "redis").start()
    try:
        yield redis.url()
    finally:
        redis.stop()


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return make_test_ca(tmp_path_factory.mktemp("ca"))


def build_world(directory: Path, ca: TestCA, **cp_options: object) -> World:
    tools = ToolServer().start()
    secure = ToolServer(tls=ca).start()
    mcp = McpServer(port=free_port()).start()
    cp = prepare_controlplane(directory / "cp", tools.port, secure.port, mcp.port, **cp_options)  # type: ignore[arg-type]
    return World(directory, tools, secure, mcp, ca, cp)


def teardown_world(world: World) -> None:
    for sidecar in world.sidecars:
        sidecar.stop()
    world.cp.stop()
    world.mcp.stop()
    world.tools.stop()
    world.secure.stop()


@pytest.fixture
def world(tmp_path: Path, test_ca: TestCA) -> Iterator[World]:
    """Tool servers, an MCP server and a running control plane (lease TTL 3 s, grace 2 s)."""
    w = build_world(tmp_path, test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)
