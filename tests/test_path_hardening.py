"""Paths and headers that mean one thing to tether's matcher and another to the server, through a real
sidecar to a raw TCP upstream that records every byte it receives: the ground truth is that nothing tether
refuses ever reaches it, and what it forwards is exactly what it matched.

The catalog grants ``GET /api/public/*`` only; ``/api/private/x`` is what every spelling tries to reach.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import World, build_world, teardown_world
from .harness import TestCA, free_port, wait_until

CATALOG = """
capabilities:
  public.read:  {{http: {{host: 127.0.0.1, port: {tap}, methods: [GET], path: "/api/public/*"}}}}
  public.write: {{http: {{host: 127.0.0.1, port: {tap}, methods: [POST], path: "/api/public/*"}}}}
  private.read: {{http: {{host: 127.0.0.1, port: {tap}, methods: [GET], path: "/api/private/*"}}}}
"""


class RawTap:
    """A TCP server that answers every request ``200 ok`` and keeps the raw bytes of each request head."""

    def __init__(self) -> None:
        self.port = free_port()
        self.heads: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> RawTap:
        self.thread.start()
        return self

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            conn.settimeout(10)
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
            if data:
                self.heads.append(data.split(b"\r\n\r\n", 1)[0])
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    def stop(self) -> None:
        self.sock.close()

    def targets(self) -> list[bytes]:
        return [head.split(b"\r\n", 1)[0] for head in self.heads]


@pytest.fixture(scope="module")
def tapped(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[tuple[World, RawTap, Any]]:
    tap = RawTap().start()
    world = build_world(tmp_path_factory.mktemp("paths"), test_ca)
    world.cp.catalog_path.write_text(CATALOG.format(tap=tap.port))
    world.cp.start()
    try:
        sidecar = world.sidecar(world.cp.issue("paths", {"public.read": "direct", "public.write": "direct"}))
        yield world, tap, sidecar
    finally:
        teardown_world(world)
        tap.stop()


def send(proxy: str, raw: bytes) -> bytes:
    """Raw bytes to the sidecar's proxy port; the whole answer back."""
    host, port = proxy.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(raw)
        out = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, body = out.partition(b"\r\n\r\n")
                    length = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")]
                    if length and len(body) >= length[0]:
                        break
        except TimeoutError:
            pass
        return out


def get(tap: RawTap, target: str, method: str = "GET", headers: str = "") -> bytes:
    url = target if target.startswith(("*", "127.")) else f"http://127.0.0.1:{tap.port}{target}"
    return (f"{method} {url} HTTP/1.1\r\nHost: 127.0.0.1:{tap.port}\r\n{headers}Connection: close\r\n\r\n"
            .encode("utf-8", "surrogateescape"))


REFUSED_TARGETS = [
    "/api/public/#/../../private/x",
    "/api/public/x#frag",
    "/api/public/..;/private/x",
    "/api/public/..;jsessionid=1/private/x",
    "/api/public/x/..;/..;/private/x",
    "/api/public/%2e%2e;/private/x",
    "/api/public/%c0%ae%c0%ae/private/x",
    "/api/public/%c0%2e%c0%2e/private/x",
    "/api/public/%e0%80%ae%e0%80%ae/private/x",
    "/api/public/\uff0e\uff0e/private/x",
    "/api/public/%ef%bc%8e%ef%bc%8e/private/x",
    "/api/public/%u002e%u002e/private/x",
    "/api/public/%U002E%U002E/private/x",
    "/api/public/%252e%252e/private/x",
    "/api/public/%25252e%25252e/private/x",
    "/api/public/..%252fprivate/x",
    "/api/public/..%ef%bc%8fprivate/x",
    "/api/public/%2e%2e/private/x",
    "/api/public/.%2e/private/x",
    "/api/public/x%00",
    "/api/public/x%0d%0aX-Injected: 1",
    "/api/public/. ./private/x",
]


@pytest.mark.parametrize("target", REFUSED_TARGETS)
def test_traversing_spellings_never_reach_the_server(tapped: Any, target: str) -> None:
    _, tap, sidecar = tapped
    before = len(tap.heads)
    answer = send(sidecar.proxy, get(tap, target))
    # tether's refusal, or mitmproxy's own 400 for a request line it cannot parse at all (raw CR LF, spaces)
    assert answer.startswith((b"HTTP/1.1 403", b"HTTP/1.1 400")), answer[:300]
    if answer.startswith(b"HTTP/1.1 403"):
        assert b"Tether-Error: tether.capability_absent" in answer, answer[:300]
    assert len(tap.heads) == before, tap.heads[before:]


REWRITE_HEADERS = ["X-Original-URL: /api/private/x", "X-Rewrite-URL: /api/private/x",
                   "X-HTTP-Method-Override: DELETE", "X-HTTP-Method: DELETE", "X-Method-Override: DELETE",
                   "X-Forwarded-Host: evil.example", "Forwarded: host=evil.example", "X-Forwarded-Prefix: /api/private",
                   "x-original-url: /api/private/x"]


@pytest.mark.parametrize("header", REWRITE_HEADERS)
def test_headers_that_rewrite_the_path_or_method_are_refused(tapped: Any, header: str) -> None:
    _, tap, sidecar = tapped
    before = len(tap.heads)
    answer = send(sidecar.proxy, get(tap, "/api/public/x", headers=f"{header}\r\n"))
    assert answer.startswith(b"HTTP/1.1 403") and b"tether.capability_absent" in answer, answer[:300]
    assert header.split(":")[0].lower().encode() in answer.lower()  # the message names the header
    assert len(tap.heads) == before, tap.heads[before:]


@pytest.mark.parametrize("method", ["get", "Get", "gEt", "post"])
def test_a_method_is_forwarded_as_matched_or_not_at_all(tapped: Any, method: str) -> None:
    _, tap, sidecar = tapped
    before = len(tap.heads)
    answer = send(sidecar.proxy, get(tap, "/api/public/x", method=method))
    assert answer.startswith(b"HTTP/1.1 403") and b"tether.capability_absent" in answer, answer[:300]
    assert len(tap.heads) == before, tap.heads[before:]


@pytest.mark.parametrize("target", ["*", "127.0.0.1:{port}", "/api/public/x"])
def test_asterisk_and_authority_forms_are_a_clean_refusal(tapped: Any, target: str) -> None:
    """In origin form directly to the proxy, and inside a tunnel to the granted destination."""
    _, tap, sidecar = tapped
    target = target.format(port=tap.port)
    before = len(tap.heads)
    for method in ("GET", "OPTIONS"):
        raw = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{tap.port}\r\nConnection: close\r\n\r\n".encode()
        granted = target == "/api/public/x" and method == "GET"  # origin form, Host names the destination
        answer = send(sidecar.proxy, raw)
        assert answer.startswith(b"HTTP/1.1 200" if granted else b"HTTP/1.1 4"), answer[:300]
        tunnelled = send(sidecar.proxy, f"CONNECT 127.0.0.1:{tap.port} HTTP/1.1\r\nHost: 127.0.0.1:{tap.port}"
                                        f"\r\n\r\n".encode() + raw)
        assert b"HTTP/1.1 200" in tunnelled.split(b"\r\n", 1)[0], tunnelled[:300]
        inner = tunnelled.split(b"\r\n\r\n", 1)[1]
        assert inner.startswith(b"HTTP/1.1 200" if granted else b"HTTP/1.1 4"), tunnelled[:400]
    assert "Traceback" not in sidecar.log_text, sidecar.log_text[-3000:]
    forwarded = tap.targets()[before:]
    assert all(t.startswith(b"GET /api/public/x ") for t in forwarded), forwarded


def test_what_is_granted_still_passes_and_arrives_as_sent(tapped: Any) -> None:
    _, tap, sidecar = tapped
    for target in ("/api/public/x", "/api/public/a%20b", "/api/public/caf%C3%A9", "/api/public/x;v=1",
                   "/api/public/x?q=..%2f..", "/api/public/.well-known"):
        before = len(tap.heads)
        answer = send(sidecar.proxy, get(tap, target, headers="X-Forwarded-For: 10.0.0.1\r\n"))
        assert answer.startswith(b"HTTP/1.1 200"), (target, answer[:300])
        wait_until(lambda before=before: len(tap.heads) > before, 5, what="the tap")
        assert tap.targets()[-1] == f"GET {target} HTTP/1.1".encode(), tap.targets()[-1]
