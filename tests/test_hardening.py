"""Holes a reviewer found, each closed and kept closed: raw bytes in a tunnel, upgrades, borrowed agent ids,
tunnels after termination, MCP methods without a body decision, ambiguous JSON, Host ports, report races,
a control plane started with nothing but flags, and TLS server names that front another site."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.controlplane.client import Signer
from tether.proxy import mcp
from tether.proxy.channel import ControlChannel
from tether.proxy.reporting import Reporter

from .conftest import World
from .harness import PYTHON, free_port, reports_for, wait_until


def signer(ident) -> Signer:  # type: ignore[no-untyped-def]
    return Signer(ident.agent, parse_chain_unverified(ident.wire)[-1].hash,
                  keys.load_private(ident.key_path.read_bytes()))


def tunnel(proxy: str, host: str, port: int) -> socket.socket:
    p_host, p_port = proxy.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((p_host, int(p_port)), timeout=10)
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def test_bytes_that_do_not_parse_as_http_never_pass_a_tunnel(world: World) -> None:
    ident = world.cp.issue("tun", {"issues.read": "direct"})
    sc = world.sidecar(ident)
    before = len(world.tools.hits)
    # A leading blank line makes mitmproxy's sniffing call it "not HTTP"; the server would accept it.
    sock = tunnel(sc.proxy, "127.0.0.1", world.tools.port)
    try:
        sock.sendall(b"\r\nPOST /admin HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
        sock.settimeout(5)
        try:
            answer = sock.recv(4096)
        except (TimeoutError, ConnectionError):
            answer = b""
    finally:
        sock.close()
    time.sleep(0.5)
    assert world.tools.hits[before:] == [], answer
    assert b"200 OK" not in answer


def test_upgrades_are_refused(world: World) -> None:
    ident = world.cp.issue("ws", {"echo.any": "direct"})
    sc = world.sidecar(ident)
    resp = requests.get(f"{world.tools.base}/echo", proxies=sc.proxies(), timeout=10,
                        headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                 "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert resp.status_code == 403 and resp.headers["Tether-Error"] == "tether.capability_absent"
    assert ("GET", "/echo") not in world.tools.hits


def test_a_terminated_agent_opens_no_tunnel(world: World) -> None:
    ident = world.cp.issue("tunnel-term", {"secure.issues": "direct"})
    sc = world.sidecar(ident)
    doc = world.cp.client().request("POST", "/v1/agents/tunnel-term/terminate", {"mode": "abort", "window_s": 0})
    wait_until(lambda: world.cp.client().request("GET", f"/v1/terminations/{doc['termination_id']}")["state"]
               == "terminated", 30, what="termination")
    with pytest.raises(requests.exceptions.ProxyError):
        requests.get(f"https://localhost:{world.secure.port}/repos/o/r/issues", proxies=sc.proxies(), verify=sc.ca,
                     timeout=10)
    assert world.secure.hits == []


def test_an_agent_id_belongs_to_the_tree_that_registered_it(world: World) -> None:
    bob = world.cp.issue("bob", {"issues.read": "direct"})
    alice = world.cp.issue("alice", {"issues.read": "direct"})
    client = world.cp.client(admin=False)
    for ident in (bob, alice):
        client.request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=signer(ident))
    impostor = world.cp.delegate(alice, "bob", {"issues.read": "direct"})
    with pytest.raises(ApiError) as info:
        client.request("POST", "/v1/chains/register", {"chain": impostor.wire}, signer=signer(impostor))
    assert info.value.code == "tether.chain_invalid" and info.value.details.get("reason") == "agent_id_taken"
    with pytest.raises(ApiError) as info:  # alice is nobody's ancestor of the real bob
        client.request("POST", "/v1/agents/bob/terminate", {"mode": "abort"}, signer=signer(alice))
    assert info.value.http_status == 403


def test_mcp_methods_other_than_get_delete_and_json_rpc_posts_are_absent(world: World) -> None:
    ident = world.cp.issue("mcp-put", {"mcp.add": "direct"})
    sc = world.sidecar(ident)
    resp = requests.put(world.mcp.url, data=b'{"jsonrpc":"2.0","id":1,"method":"tools/call"}', proxies=sc.proxies(),
                        timeout=10, headers={"Content-Type": "application/json"})
    assert resp.headers.get("Tether-Error") == "tether.capability_absent"


def test_json_with_repeated_keys_is_not_matched() -> None:
    with pytest.raises(mcp.NotJsonRpc):
        mcp.parse(b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"add","NAME":"drop"}}')
    with pytest.raises(mcp.NotJsonRpc):
        mcp.parse(b'{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call"}')
    assert mcp.parse(b'{"jsonrpc":"2.0","id":1,"method":"ping"}').messages[0].method == "ping"


def test_a_host_header_with_another_port_is_refused(world: World) -> None:
    ident = world.cp.issue("hostport", {"issues.read": "direct"})
    sc = world.sidecar(ident)
    resp = requests.get(f"{world.tools.base}/repos/o/r/issues", proxies=sc.proxies(), timeout=10,
                        headers={"Host": f"127.0.0.1:{world.tools.port + 1}"})
    assert resp.headers.get("Tether-Error") == "tether.unknown_destination"


def test_concurrent_flushes_deliver_every_report_once(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("flusher", {"issues.read": "direct"})
    s = signer(ident)
    world.cp.client(admin=False).request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=s)

    async def run() -> None:
        channel = ControlChannel(world.cp.url, s.agent, s.link, s.key, "run-flusher")
        reporter = Reporter(channel, tmp_path / "spool")
        for i in range(3):
            reporter.add({"call_id": f"f{i}", "resolution": "completed"})
        first = asyncio.create_task(reporter.flush())
        second = asyncio.create_task(reporter.flush())
        await asyncio.sleep(0)
        reporter.add({"call_id": "f3", "resolution": "completed"})  # arrives while a batch is on the wire
        await asyncio.gather(first, second)
        await reporter.flush()
        await channel.close()
        assert reporter.pending == []

    asyncio.run(run())
    assert sorted(r["call_id"] for r in reports_for(world.cp, "flusher")) == ["f0", "f1", "f2", "f3"]


def test_controlplane_serve_with_flags_only(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([PYTHON, "-m", "tether", "controlplane", "serve", "--listen",
                             f"127.0.0.1:{port}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return True
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                return False

        wait_until(up, 20, what="a control plane started with no catalog file")
    finally:
        proc.terminate()
        proc.wait(10)
    assert (tmp_path / "tether-signing.key").exists()


def test_tls_is_only_for_catalog_destinations(world: World) -> None:
    """CONNECT to a catalog host works, and the sidecar's CA is what the agent sees."""
    ident = world.cp.issue("tls-ok", {"secure.issues": "direct"})
    sc = world.sidecar(ident)
    sock = tunnel(sc.proxy, "localhost", world.secure.port)
    ctx = ssl.create_default_context(cafile=sc.ca)
    with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
        tls.sendall(b"GET /repos/o/r/issues HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200")


def test_upstream_tls_names_the_connect_host_whatever_sni_the_agent_sends(world: World) -> None:
    """Domain fronting: a CONNECT to a granted host with another name in the SNI must not reach that name."""
    ident = world.cp.issue("fronting", {"secure.issues": "direct"})
    sc = world.sidecar(ident)
    ctx = ssl.create_default_context(cafile=sc.ca)
    ctx.check_hostname = False  # the agent asks the sidecar for "evil.example"; the sidecar's CA signs it
    for sni in ("evil.example", "localhost"):
        before = len(world.secure.snis)
        sock = tunnel(sc.proxy, "localhost", world.secure.port)
        with ctx.wrap_socket(sock, server_hostname=sni) as tls:
            tls.sendall(b"GET /repos/o/r/issues HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200"), (sni, data[:200])
        assert world.secure.snis[before:] == ["localhost"], (sni, world.secure.snis[before:])


def test_an_ipv6_destination_in_the_catalog_is_reachable_and_nothing_else_there(world: World) -> None:
    """A catalog host "[::1]" matches mitmproxy's bare "::1": the granted path passes, the rest is absent."""
    from aiohttp import web

    hits: list[str] = []
    loop = asyncio.new_event_loop()

    async def v6(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"family": "ipv6"})

    app = web.Application()
    app.router.add_get("/{tail:.*}", v6)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    # The catalog names [::1] on the IPv4 tool server's port number, a separate socket on the IPv6 loopback.
    loop.run_until_complete(web.TCPSite(runner, "::1", world.tools.port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ident = world.cp.issue("v6", {"v6.read": "direct"})
        sc = world.sidecar(ident)
        base = f"http://[::1]:{world.tools.port}"
        ok = requests.get(f"{base}/v6", proxies=sc.proxies(), timeout=10)
        assert ok.status_code == 200 and ok.json() == {"family": "ipv6"}
        other = requests.get(f"{base}/admin", proxies=sc.proxies(), timeout=10)
        assert other.status_code == 403 and other.headers["Tether-Error"] == "tether.capability_absent"
        assert hits == ["/v6"]
        reports = {r["url"] for r in wait_reports_for(world, "v6", 2)}
        assert reports == {f"{base}/v6", f"{base}/admin"}
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def wait_reports_for(world: World, agent: str, count: int) -> list[dict]:
    wait_until(lambda: len(reports_for(world.cp, agent)) >= count, 15, what=f"{count} reports of {agent}")
    return reports_for(world.cp, agent)
