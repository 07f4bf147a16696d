"""Header and framing hygiene (RFC 9112), through a real sidecar to a real aiohttp tool server that logs every
request it receives, with requests written byte by byte on a raw socket: malformed fields are refused with
``400 tether.bad_request``, trailers pass without a traceback, ``Expect: 100-continue`` gets no 100 when the
call is refused (and the refusal at once, without waiting for the body), hop-by-hop fields never reach the
tool, the override-header family in both spellings and method-override query parameters are refused (and a
method override in a form or JSON body unless the capability grants that method), and so are path characters
servers fold into "/" or "." and invisible ones. The ground truth: the tool never sees what was refused, and the
sidecar logs no traceback.
"""

from __future__ import annotations

import json
import socket
import unicodedata
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from .conftest import World, build_world, teardown_world
from .harness import TestCA, ToolServer, wait_until
from .test_path_hardening import RawTap

CATALOG = """
capabilities:
  public.read:  {{http: {{host: 127.0.0.1, port: {port}, methods: [GET], path: "/api/public/*"}}}}
  public.write: {{http: {{host: 127.0.0.1, port: {port}, methods: [POST], path: "/api/public/*"}}}}
  private.read: {{http: {{host: 127.0.0.1, port: {port}, methods: [GET, POST], path: "/api/private/*"}}}}
  raw.read:     {{http: {{host: 127.0.0.1, port: {tap}, methods: [GET], path: "/api/public/*"}}}}
  forms.edit:   {{http: {{host: 127.0.0.1, port: {port}, methods: [POST, PUT], path: "/api/forms/*"}}}}
"""


class LoggingTool(ToolServer):
    """Answers every request 200 with what it received; ``seen`` keeps each (method, path and query, headers,
    body)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, list[tuple[str, str]], bytes]] = []

    def _app(self) -> web.Application:
        async def anything(request: web.Request) -> web.Response:
            body = await request.read()
            self.seen.append((request.method, request.path_qs, list(request.headers.items()), body))
            return web.json_response({"path": request.path_qs, "body": body.decode("utf-8", "replace")})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", anything)
        return app

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.seen]


@pytest.fixture(scope="module")
def world_and_tap(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[tuple[Any, RawTap]]:
    tool, tap = LoggingTool().start(), RawTap().start()
    world: World = build_world(tmp_path_factory.mktemp("wire"), test_ca)
    world.cp.catalog_path.write_text(CATALOG.format(port=tool.port, tap=tap.port))
    world.cp.start()
    try:
        sidecar = world.sidecar(world.cp.issue("wire", {"public.read": "direct", "public.write": "direct",
                                                        "private.read": "absent", "raw.read": "direct",
                                                        "forms.edit": "direct"}))
        yield (tool, sidecar), tap
        # Whatever was sent, the sidecar wrote no traceback (stderr and its log go to the same file).
        assert "Traceback" not in sidecar.log_text, sidecar.log_text[-3000:]
    finally:
        teardown_world(world)
        tool.stop()
        tap.stop()


@pytest.fixture(scope="module")
def wired(world_and_tap: tuple[Any, RawTap]) -> tuple[LoggingTool, Any]:
    return world_and_tap[0]


@pytest.fixture(scope="module")
def tapped(world_and_tap: tuple[Any, RawTap]) -> tuple[RawTap, Any]:
    """A raw TCP upstream that keeps every request head byte for byte (no HTTP parser of its own to refuse
    first), behind the same sidecar."""
    (_, sidecar), tap = world_and_tap
    return tap, sidecar


def connect(proxy: str) -> socket.socket:
    host, port = proxy.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=20)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One final (non-1xx) answer: status, headers (lower-case names), body (by Content-Length)."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the sidecar closed without an answer: {data!r}"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status >= 200:
            break
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(data) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return status, headers, data[:length]


def send(proxy: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(proxy) as sock:
        sock.sendall(raw)
        return read_answer(sock)


def request(tool: LoggingTool, target: str, *, method: str = "GET", fields: bytes = b"", body: bytes = b"") -> bytes:
    length = b"Content-Length: %d\r\n" % len(body) if body or method == "POST" else b""
    return (f"{method} http://127.0.0.1:{tool.port}{target} HTTP/1.1\r\nHost: 127.0.0.1:{tool.port}\r\n"
            .encode()
            + fields + length + b"Connection: close\r\n\r\n" + body)


def refused(answer: tuple[int, dict[str, str], bytes], status: int, code: str, reason: str | None = None) -> None:
    got, headers, body = answer
    assert got == status and headers.get("tether-error") == code, answer
    if reason is not None:
        assert json.loads(body)["error"]["reason"] == reason, body


def test_a_plain_request_reaches_the_tool(wired: Any) -> None:
    tool, sidecar = wired
    status, _, body = send(sidecar.proxy, request(tool, "/api/public/plain", fields=b"X-Note: fine\r\n"))
    assert status == 200 and json.loads(body)["path"] == "/api/public/plain"
    assert tool.paths()[-1] == "/api/public/plain"


MALFORMED = {
    "obs-fold": b"X-Note: first\r\n second\r\n",
    "obs-fold with a tab": b"X-Note: first\r\n\tX-Original-URL: /api/private/x\r\n",
    "a bare CR in a value": b"X-Note: one\rX-Original-URL: /api/private/x\r\n",
    "a space before the colon": b"X-Note : value\r\n",
    "a NUL in a value": b"X-Note: a\x00b\r\n",
    "a name that is not a token": b"X(Note): value\r\n",
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_fields_are_refused_as_bad_requests(tapped: Any, what: str) -> None:
    tap, sidecar = tapped
    target = f"/api/public/malformed-{len(tap.heads)}-{what.replace(' ', '-')}"
    raw = (f"GET http://127.0.0.1:{tap.port}{target} HTTP/1.1\r\nHost: 127.0.0.1:{tap.port}\r\n".encode()
           + MALFORMED[what] + b"Connection: close\r\n\r\n")
    answer = send(sidecar.proxy, raw)
    assert not [t for t in tap.targets() if target.encode() in t]
    if answer[0] == 400 and "tether-error" not in answer[1]:
        return  # mitmproxy's own parser refused it first (a 400 of its own): it never reached tether or the tool
    refused(answer, 400, "tether.bad_request", "malformed_field")


def test_a_well_formed_request_reaches_the_raw_upstream(tapped: Any) -> None:
    tap, sidecar = tapped
    raw = (f"GET http://127.0.0.1:{tap.port}/api/public/well-formed HTTP/1.1\r\nHost: 127.0.0.1:{tap.port}\r\n"
           "X-Note: fine\r\nConnection: close\r\n\r\n").encode()
    assert send(sidecar.proxy, raw)[0] == 200
    assert tap.targets()[-1] == b"GET /api/public/well-formed HTTP/1.1"


def trailered(tool: LoggingTool, target: str, trailer: bytes) -> bytes:
    return (f"POST http://127.0.0.1:{tool.port}{target} HTTP/1.1\r\nHost: 127.0.0.1:{tool.port}\r\n"
            "Transfer-Encoding: chunked\r\nTrailer: X-Checksum\r\nConnection: close\r\n\r\n"
            "5\r\nhello\r\n6\r\n world\r\n0\r\n").encode() + trailer + b"\r\n"


@pytest.mark.parametrize("trailer", [b"X-Checksum: abc\r\n", b"X-Original-URL: /api/private/x\r\n",
                                     b"X-Checksum: a\r\n b\r\n"], ids=["plain", "override", "obs-fold"])
def test_chunked_trailers_are_discarded_without_a_traceback(wired: Any, trailer: bytes) -> None:
    tool, sidecar = wired
    target = f"/api/public/trailers-{len(tool.seen)}"
    status, _, body = send(sidecar.proxy, trailered(tool, target, trailer))
    assert status == 200, body
    assert json.loads(body)["body"] == "hello world"
    _, path, headers, sent = tool.seen[-1]
    assert path == target and sent == b"hello world"
    names = {n.lower() for n, _ in headers}
    assert not names & {"x-checksum", "x-original-url", "trailer"}, headers


def expect_request(tool: LoggingTool, target: str) -> bytes:
    return (f"POST http://127.0.0.1:{tool.port}{target} HTTP/1.1\r\nHost: 127.0.0.1:{tool.port}\r\n"
            "Content-Length: 11\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n").encode()


def test_expect_continue_to_a_refused_capability_is_answered_at_once(wired: Any) -> None:
    """No 100 (the body is not wanted) and the refusal without waiting for the body: the client never sends one
    here, so an answer that waited for it would never come (and the read would time out)."""
    tool, sidecar = wired
    with connect(sidecar.proxy) as sock:
        sock.sendall(expect_request(tool, "/api/private/upload"))
        status, headers, body = read_answer(sock)  # no body sent: the refusal must not wait for one
        assert headers.get("connection") == "close", headers
    refused((status, headers, body), 403, "tether.capability_absent")
    assert "/api/private/upload" not in tool.paths()


def test_a_refused_client_that_sends_its_body_anyway_still_gets_the_refusal(wired: Any) -> None:
    tool, sidecar = wired
    with connect(sidecar.proxy) as sock:
        sock.sendall(expect_request(tool, "/api/private/upload-anyway") + b"hello world")
        answer = read_answer(sock)
    refused(answer, 403, "tether.capability_absent")
    assert "/api/private/upload-anyway" not in tool.paths()


def test_expect_continue_to_a_granted_capability_gets_100_after_the_decision(wired: Any) -> None:
    tool, sidecar = wired
    with connect(sidecar.proxy) as sock:
        sock.sendall(expect_request(tool, "/api/public/upload"))
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(65536)
            assert chunk, interim
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100"), interim
        assert "/api/public/upload" not in tool.paths()  # nothing left before the body
        sock.sendall(b"hello world")
        status, _, body = read_answer(sock)
    assert status == 200 and json.loads(body)["body"] == "hello world"
    _, _, headers, sent = tool.seen[-1]
    assert sent == b"hello world" and "expect" not in {n.lower() for n, _ in headers}


def test_hop_by_hop_fields_do_not_reach_the_tool(wired: Any) -> None:
    tool, sidecar = wired
    fields = (b"Proxy-Connection: keep-alive\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
              b"Proxy-Authorization: Basic YWdlbnQ6c2VjcmV0\r\nX-Hop: only-for-the-sidecar\r\n"
              b"Connection: X-Hop\r\nX-End-To-End: kept\r\n")
    status, _, _ = send(sidecar.proxy, request(tool, "/api/public/hops", fields=fields))
    assert status == 200
    _, path, headers, _ = tool.seen[-1]
    names = {n.lower() for n, _ in headers}
    assert path == "/api/public/hops"
    assert not names & {"proxy-connection", "keep-alive", "te", "proxy-authorization", "x-hop"}, headers
    assert "x-end-to-end" in names


OVERRIDES = [
    "X-Original-URL: /api/private/x", "X_Original_URL: /api/private/x", "x_original_url: /api/private/x",
    "X-HTTP-Method-Override: DELETE", "X_HTTP_Method_Override: DELETE", "X-Method-Override: DELETE",
    "X-Forwarded-Host: evil.example", "X_Forwarded_Host: evil.example",
    "X-Forwarded-Uri: /api/private/x", "X_Forwarded_Uri: /api/private/x",
    "X-Envoy-Original-Path: /api/private/x", "X_Envoy_Original_Path: /api/private/x",
    "X-Original-Method: DELETE", "X-Forwarded-Method: DELETE", "X_Forwarded_Method: DELETE",
    "X-Original-Host: evil.example", "X-Host: evil.example", "X-Forwarded-Proto: https",
    "X-Rewrite-URL: /api/private/x", "X-Forwarded-Prefix: /api/private",
]


@pytest.mark.parametrize("field", OVERRIDES)
def test_override_headers_are_refused_in_every_spelling(wired: Any, field: str) -> None:
    tool, sidecar = wired
    target = f"/api/public/override-{len(tool.seen)}"
    answer = send(sidecar.proxy, request(tool, target, method="POST", fields=field.encode() + b"\r\n", body=b"{}"))
    reason = "underscore_header" if "_" in field.split(":")[0] else "rewrite_header"
    refused(answer, 403, "tether.capability_absent", reason)
    assert target not in tool.paths()


def test_underscore_spellings_of_tether_s_own_headers_are_refused(wired: Any) -> None:
    tool, sidecar = wired
    for field in (b"Tether_Chain: x", b"Content_Length: 0", b"Transfer_Encoding: chunked", b"Mcp_Method: tools/list"):
        target = f"/api/public/spelled-{len(tool.seen)}"
        refused(send(sidecar.proxy, request(tool, target, fields=field + b"\r\n")), 403, "tether.capability_absent",
                "underscore_header")
        assert target not in tool.paths()


@pytest.mark.parametrize("query", ["_method=DELETE", "x=1&_method=DELETE", "_METHOD=put", "%5Fmethod=DELETE",
                                   "a=1;_method=DELETE", "_HttpMethod=DELETE", "X-HTTP-Method-Override=DELETE"])
def test_method_override_query_parameters_are_refused(wired: Any, query: str) -> None:
    tool, sidecar = wired
    target = f"/api/public/form-{len(tool.seen)}?{query}"
    answer = send(sidecar.proxy, request(tool, target, method="POST", body=b"{}"))
    refused(answer, 403, "tether.capability_absent", "method_override_param")
    assert not [p for p in tool.paths() if p.startswith(target.split("?")[0])]


FORM = b"Content-Type: application/x-www-form-urlencoded\r\n"
MULTIPART = b"Content-Type: multipart/form-data; boundary=XyZ\r\n"


def multipart(name: str, value: str) -> bytes:
    return (f'--XyZ\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
            '--XyZ\r\nContent-Disposition: form-data; name="note"\r\n\r\nhi\r\n--XyZ--\r\n').encode()


@pytest.mark.parametrize(("fields", "body"), [
    (FORM, b"title=x&_method=DELETE"), (FORM, b"_METHOD=delete"), (FORM, b"a=1;%5Fmethod=DELETE"),
    (FORM, b"X-HTTP-Method-Override=PATCH"), (FORM, b"_method=GET"),  # GET is another capability's (public.read)
    (MULTIPART, multipart("_method", "DELETE")), (b"Content-Type: application/json\r\n", b'{"_method": "DELETE"}'),
], ids=["form", "upper-case", "encoded", "override-name", "other-capability", "multipart", "json"])
def test_a_method_override_in_the_body_is_refused_unless_the_capability_grants_that_method(
        wired: Any, fields: bytes, body: bytes) -> None:
    tool, sidecar = wired
    target = f"/api/public/form-body-{len(tool.seen)}"
    refused(send(sidecar.proxy, request(tool, target, method="POST", fields=fields, body=body)), 403,
            "tether.capability_absent", "method_override_body")
    assert target not in tool.paths()


def test_a_method_override_in_the_body_the_capability_grants_passes(wired: Any) -> None:
    tool, sidecar = wired
    for body in (b"title=x&_method=PUT", b"title=the method is fast"):  # PUT is forms.edit's too; prose passes
        status, _, _ = send(sidecar.proxy, request(tool, "/api/forms/1", method="POST", fields=FORM, body=body))
        assert status == 200 and tool.seen[-1][3] == body


def test_an_ordinary_method_parameter_passes(wired: Any) -> None:
    tool, sidecar = wired
    status, _, _ = send(sidecar.proxy, request(tool, "/api/public/search?method=fast", method="POST", body=b"{}"))
    assert status == 200 and tool.paths()[-1] == "/api/public/search?method=fast"


FOLDING = {"U+2215 division slash": "\u2215", "U+2044 fraction slash": "\u2044", "U+29F8 big solidus": "\u29f8",
           "U+3002 ideographic full stop": "\u3002", "U+FF61 halfwidth ideographic full stop": "\uff61",
           "U+200B zero width space": "\u200b", "U+200C zero width non-joiner": "\u200c",
           "U+200D zero width joiner": "\u200d", "U+2060 word joiner": "\u2060", "U+FEFF BOM": "\ufeff",
           "U+00AD soft hyphen": "\u00ad", "U+202E right-to-left override": "\u202e"}


@pytest.mark.parametrize("spelling", ["raw", "percent", "double percent"])
@pytest.mark.parametrize("what", list(FOLDING))
def test_path_characters_servers_fold_or_hide_are_refused(wired: Any, what: str, spelling: str) -> None:
    tool, sidecar = wired
    char = FOLDING[what]
    encoded = "".join(f"%{b:02X}" for b in char.encode())
    piece = {"raw": char, "percent": encoded, "double percent": encoded.replace("%", "%25")}[spelling]
    marker = f"fold-{len(tool.seen)}-{sum(map(ord, what + spelling))}"
    target = f"/api/public/{marker}{piece}{piece}x"  # granted, but for the character
    answer = send(sidecar.proxy, request(tool, target))
    assert not [p for p in tool.paths() if marker in p]
    if spelling == "raw" and answer[0] == 400 and "tether-error" not in answer[1]:
        return  # mitmproxy's own parser refuses a request line that is not ASCII: it never reached the tool
    refused(answer, 403, "tether.capability_absent", "path_character")


def test_the_sidecar_logged_no_traceback(wired: Any) -> None:
    _, sidecar = wired
    wait_until(lambda: sidecar.log_text, 10, what="the sidecar's log")
    assert "Traceback" not in sidecar.log_text, sidecar.log_text[-3000:]


# -- the rules alone (pure: proxy.decision and the edge's one pass over the fields) ---------------------------
def test_every_folding_and_format_character_is_refused_in_a_path() -> None:
    from tether.proxy.decision import FOLDING_CHARS, Refused, decide

    from .test_decision import CATALOG, STATE, facts

    format_chars = [chr(c) for c in range(0x80, 0x30000) if unicodedata.category(chr(c)) == "Cf"]
    for char in sorted(FOLDING_CHARS) + format_chars:
        encoded = "".join(f"%{b:02x}" for b in char.encode())
        for path in (f"/files/a{char}b", f"/files/a{encoded}b", f"/files/a{encoded.replace('%', '%25')}b"):
            answer = decide(CATALOG, STATE, facts(path=path))
            assert isinstance(answer, Refused) and answer.refusal.details["reason"] == "path_character", (path, answer)
    for path in ("/files/caf\u00e9", "/files/%C3%A9t%C3%A9", "/files/a?q=\u200b", "/files/a?method=fast"):
        assert not isinstance(decide(CATALOG, STATE, facts(path=path)), Refused), path


def test_the_field_pass_names_malformed_fields_and_underscore_spellings() -> None:
    from tether.proxy.enforce import header_facts

    ok = header_facts(((b"Host", b"a"), (b"X-Note", b"v"), (b"X-Original-URL", b"/x")))
    assert ok.malformed is None and ok.spelled == () and ok["x-original-url"] == "/x"
    for fields in (((b"X-A", b"1\r\n 2"),), ((b"X-A", b"1\r2"),), ((b"X-A", b"1\n2"),), ((b"X-A", b"\x00"),),
                   ((b"X A", b"1"),), ((b"X-A ", b"1"),), ((b"", b"1"),)):
        assert header_facts(fields).malformed is not None, fields
    spelled = header_facts(((b"X_Original_URL", b"/x"), (b"x_forwarded_HOST", b"e"), (b"X_Custom_Thing", b"1")))
    assert spelled.spelled == ("X_Original_URL", "x_forwarded_HOST") and spelled.malformed is None


def test_the_body_override_reader_reads_forms_multipart_and_json_as_frameworks_do() -> None:
    from tether.proxy.decision import body_override

    form = "application/x-www-form-urlencoded; charset=utf-8"
    assert body_override(form, b"a=1&_method=delete") == ("_method", "DELETE")
    assert body_override(form, b"a=1;%5F%5Fmethod=%70ut") == ("%5F%5Fmethod", "PUT")
    assert body_override(form, b"method=fast&note=_method") is None  # a value is not a field name
    assert body_override("Multipart/Form-Data; boundary=b", multipart("_HttpMethod", "patch")) == ("_HttpMethod",
                                                                                                 "PATCH")
    assert body_override("application/vnd.api+json", b'{"x": {"_method": "DELETE"}, "X-HTTP-Method": "put"}') == (
        "X-HTTP-Method", "PUT")  # top-level keys only, as Laravel reads its input
    assert body_override(form, b"_%6Dethod=DELETE") == ("_%6Dethod", "DELETE")  # the name as Rack decodes it
    assert body_override("application/json", b'{"_\\u006dethod": "DELETE"}') == ("_method", "DELETE")
    assert body_override("application/json", b'[{"_method": "DELETE"}]') is None
    assert body_override("application/json", b"{not json _method") is None
    assert body_override("text/plain", b"_method=DELETE") is None  # no framework reads a text body's fields
    assert body_override(None, b"_method=DELETE") is None
