"""The catalog's index gives exactly the answers the linear scan gave, over generated catalogs and requests.

The scan below is the matcher as it was before the index (issue 17): every capability tried in catalog
order. It is kept here only as the reference the indexed matcher must agree with, call for call.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.capability.catalog import Catalog, host_key, normalize_url, parse_catalog, safe_path
from tether.capability.credentials import Credential


# -- the linear scan, as it was ----------------------------------------------------------------------
def scan_match_http(cat: Catalog, host: str, port: int, method: str, path: str) -> list[str]:
    clean = safe_path(path)
    if clean is None:
        return []
    host, method = host_key(host), method.upper()
    return [c.name for c in cat.capabilities.values()
            if c.http is not None and c.http.matches(host, port, method, clean)]


def scan_mcp_server(cat: Catalog, url: str) -> str | None:
    normalized = normalize_url(url)
    return normalized if any(c.mcp is not None and c.mcp.server == normalized
                             for c in cat.capabilities.values()) else None


def scan_match_mcp(cat: Catalog, server: str, tool: str) -> list[str]:
    return [c.name for c in cat.capabilities.values()
            if c.mcp is not None and c.mcp.server == server and c.mcp.tool == tool]


def scan_mcp_tools(cat: Catalog, server: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in cat.capabilities.values():
        if c.mcp is not None and c.mcp.server == server:
            out.setdefault(c.mcp.tool, []).append(c.name)
    return out


def scan_knows_host(cat: Catalog, host: str, port: int) -> bool:
    host = host_key(host)
    for c in cat.capabilities.values():
        if c.http is not None and c.http.host == host and c.http.port in (None, port):
            return True
        if c.mcp is not None:
            parts = urlsplit(c.mcp.server)
            if host_key(parts.hostname or "") == host and parts.port == port:
                return True
    return False


def scan_mcp_credential(cat: Catalog, server: str) -> Credential | None:
    for c in cat.capabilities.values():
        if c.mcp is not None and c.mcp.server == server and c.credential:
            return cat.credentials[c.credential]
    return None


# -- generated catalogs ------------------------------------------------------------------------------
CATALOG_HOSTS = ["a.com", "A.Com", "b.org", "10.0.0.1", "[::1]", "[0:0::1]", "[2001:db8::1]"]
REQUEST_HOSTS = ["a.com", "A.COM.", "a.com.", "b.org", "B.ORG", "c.net", "a.com.evil", "10.0.0.1", "::1",
                 "0::1", "[::1]", "2001:DB8:0::1", "::2", "", "xn--a", "a.com:443"]
PORTS = [80, 443, 8000, 8080, 9000]
METHODS = ["GET", "GET", "POST", "DELETE"]  # GET twice: methods overlap more often
SEGMENTS = ["", "a", "b", "ab", "v1", "a.b", "*", "*", "a*", "*b", "a*b", ";x", "%41", "*.json"]
FILLERS = ["", "a", "b", "a/b", "v1", "x.y", "/", "..", "%2e", ";p", "b*"]
MCP_URLS = ["http://m.internal:8000/mcp", "HTTP://M.Internal:8000/mcp/", "https://m.internal/mcp",
            "https://m.internal:443/mcp", "http://[::1]:9000/mcp", "http://m.internal:8000/other"]
CREDENTIALS = {"k1": {"header": "X-Key", "format": "{secret}"}, "k2": {"header": "Authorization",
                                                                      "format": "Bearer {secret}"},
               "k3": {"header": "X-Key", "format": "{secret}", "insecure_plain_http": "loopback"}}


def path_globs() -> st.SearchStrategy[str]:
    by_segment = st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4).map(lambda s: "/" + "/".join(s))
    raw = st.text(alphabet="ab/*.;%-", max_size=10).map(lambda t: "/" + t)
    return st.one_of(by_segment, raw)


def http_specs(hosts: list[str]) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"host": st.sampled_from(hosts), "methods": st.lists(st.sampled_from(METHODS), min_size=1, max_size=3),
         "path": path_globs()},
        optional={"port": st.sampled_from(PORTS)},
    )


def _mcp_credentials(url: str) -> list[str | None]:
    if url.lower().startswith("https:"):
        return [None, "k1", "k2"]
    return [None, "k3"] if "[::1]" in url else [None]


@st.composite
def catalogs(draw: st.DrawFn) -> Catalog:
    # one credential (or none) per MCP server, as parsing requires; normalized servers may share one
    # (over https; a plain-http server only k3, on loopback only: catalog._check_route)
    server_credential = {normalize_url(url): draw(st.sampled_from(_mcp_credentials(url))) for url in MCP_URLS}
    # a few hosts per catalog, so that capabilities overlap on one host as often as they differ
    hosts = draw(st.lists(st.sampled_from(CATALOG_HOSTS), min_size=1, max_size=3))
    n = draw(st.integers(min_value=1, max_value=14))
    caps: dict[str, dict] = {}
    for i in range(n):
        if draw(st.integers(0, 4)) == 0:
            url = draw(st.sampled_from(MCP_URLS))
            spec: dict = {"mcp": {"url": url, "tool": draw(st.sampled_from(["t1", "t2", "t3"]))}}
            if server_credential[normalize_url(url)]:
                spec["credential"] = server_credential[normalize_url(url)]
        else:
            spec = {"http": draw(http_specs(hosts))}
            if draw(st.booleans()):  # a credential goes to one scheme and port
                spec["credential"] = draw(st.sampled_from(["k1", "k2"]))
                spec["http"].update(scheme="https", port=draw(st.sampled_from(PORTS)))
        caps[f"cap{draw(st.integers(0, 99))}.{i}"] = spec  # names in no sorted order: catalog order matters
    return parse_catalog(yaml.safe_dump({"credentials": CREDENTIALS, "capabilities": caps}, sort_keys=False),
                         "generated.yaml")


@st.composite
def requests(draw: st.DrawFn, cat: Catalog) -> tuple[str, int, str, str]:
    """A request, often built from one of the catalog's own hosts and globs so that many of them match."""
    https = [c.http for c in cat.capabilities.values() if c.http is not None]
    if https and draw(st.booleans()):
        h = draw(st.sampled_from(https))
        host = draw(st.sampled_from([h.host, h.host.upper(), h.host + ".", h.host.strip("[]")]))
        port = h.port if h.port is not None and draw(st.booleans()) else draw(st.sampled_from(PORTS))
        method = draw(st.sampled_from([*h.methods, h.methods[0].lower(), "PATCH"]))
        parts = h.path.split("*")
        path = parts[0] + "".join(draw(st.sampled_from(FILLERS)) + part for part in parts[1:])
    else:
        host = draw(st.sampled_from(REQUEST_HOSTS))
        port = draw(st.sampled_from(PORTS))
        method = draw(st.sampled_from([*METHODS, "get", "PATCH"]))
        path = draw(st.one_of(path_globs(), st.text(alphabet="ab/.;%?#*", max_size=10)))
    if draw(st.integers(0, 5)) == 0:
        path += draw(st.sampled_from(["?q=1", "?/a/b", "#f", "?"]))
    return host, port, method, path


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cat=catalogs())
def test_indexed_matching_gives_the_linear_scans_answers(data: st.DataObject, cat: Catalog) -> None:
    for _ in range(12):
        host, port, method, path = data.draw(requests(cat))
        expected = scan_match_http(cat, host, port, method, path)
        assert cat.match_http(host, port, method, path) == expected
        assert cat.match_http(host, port, method, path) == expected  # the remembered answer, too
        assert cat.knows_host(host, port) is scan_knows_host(cat, host, port)
    for url in [*MCP_URLS, "http://m.internal/mcp", "http://[0::1]:9000/mcp/", "http://other:8000/mcp"]:
        assert cat.mcp_server(url) == scan_mcp_server(cat, url)
        server = normalize_url(url)
        assert cat.mcp_tools(server) == scan_mcp_tools(cat, server)
        assert cat.mcp_credential(server) == scan_mcp_credential(cat, server)
        for tool in ("t1", "t2", "t3", "t4"):
            assert cat.match_mcp(server, tool) == scan_match_mcp(cat, server, tool)
        host = urlsplit(server)
        assert cat.knows_host(host.hostname or "", host.port) is scan_knows_host(cat, host.hostname or "", host.port)


def test_answers_are_copies_the_caller_may_change() -> None:
    """The index holds its lists for every later call: what a caller gets back must not be them."""
    cat = parse_catalog("capabilities:\n"
                        "  a: {http: {host: h.com, methods: [GET], path: '/x*'}}\n"
                        "  m: {mcp: {url: 'http://m:80/mcp', tool: t}}\n")
    cat.match_http("h.com", 80, "GET", "/x").append("b")
    cat.match_mcp("http://m:80/mcp", "t").append("b")
    cat.mcp_tools("http://m:80/mcp")["t"].append("b")
    assert cat.match_http("h.com", 80, "GET", "/x") == ["a"]
    assert cat.match_mcp("http://m:80/mcp", "t") == ["m"]
    assert cat.mcp_tools("http://m:80/mcp") == {"t": ["m"]}


def test_a_glob_starred_in_its_first_segment_is_tried_with_the_literal_ones_in_catalog_order() -> None:
    cat = parse_catalog("capabilities:\n"
                        "  one: {http: {host: h.com, methods: [GET], path: '/v1/*'}}\n"
                        "  two: {http: {host: h.com, methods: [GET], path: '/*'}}\n"
                        "  three: {http: {host: h.com, methods: [GET, GET], path: '/v1/x'}}\n"
                        "  four: {http: {host: h.com, methods: [GET], path: '/v*/x'}}\n"
                        "  five: {http: {host: h.com, methods: [GET], path: '/v1'}}\n")
    assert cat.match_http("h.com", 80, "GET", "/v1/x") == ["one", "two", "three", "four"]
    assert cat.match_http("h.com", 80, "GET", "/v1") == ["two", "five"]
    assert cat.match_http("h.com", 80, "GET", "/v2/x") == ["two", "four"]
    assert cat.match_http("h.com", 80, "GET", "/v1x/x") == ["two", "four"]
