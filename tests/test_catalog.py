"""The capability catalog: strict parsing, content hashing, and matching calls to capability names."""

from __future__ import annotations

import hashlib
import json
import textwrap

import pytest

from tether.capability.catalog import normalize_url, parse_catalog, safe_path
from tether.capability.errors import CATALOG_INVALID, UNKNOWN_CAPABILITY, CatalogError, UnknownCapability

DESIGN_CATALOG = """\
capabilities:
  github.issues.read:  {http: {host: api.github.com, methods: [GET], path: "/repos/*/*/issues*"}}
  github.issues.write: {http: {host: api.github.com, methods: [POST, PATCH], path: "/repos/*/*/issues*"}}
  llm.openai:          {http: {host: api.openai.com, methods: [POST], path: "/v1/*"}}
  mail.send:           {mcp: {url: "http://mail-mcp.internal:8000/mcp", tool: send_email}}
roles:                 # optional presets of capability -> tier
  researcher: {github.issues.read: direct, llm.openai: direct, mail.send: approval}
"""


@pytest.fixture(scope="module")
def catalog():
    return parse_catalog(DESIGN_CATALOG, "design.yaml")


def one_cap(spec: str, name: str = "svc.call") -> str:
    return f"capabilities:\n  {name}: {spec}\n"


def refused(text: str, source: str = "cat.yaml") -> CatalogError:
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, source)
    assert info.value.code == CATALOG_INVALID
    assert str(info.value).startswith(f"{CATALOG_INVALID}: {source}: ")
    return info.value


# -- parsing ---------------------------------------------------------------------------------------
def test_design_example_parses(catalog):
    assert catalog.names() == ["github.issues.read", "github.issues.write", "llm.openai", "mail.send"]
    read = catalog.capabilities["github.issues.read"]
    assert read.http is not None and read.mcp is None
    assert (read.http.host, read.http.methods, read.http.path, read.http.port) == (
        "api.github.com", ("GET",), "/repos/*/*/issues*", None,
    )
    send = catalog.capabilities["mail.send"]
    assert send.mcp is not None and send.http is None
    assert (send.mcp.url, send.mcp.tool) == ("http://mail-mcp.internal:8000/mcp", "send_email")
    assert catalog.role("researcher") == {
        "github.issues.read": "direct", "llm.openai": "direct", "mail.send": "approval",
    }
    assert catalog.source == "design.yaml"


def test_optional_fields_parse():
    cat = parse_catalog(
        "version: 3\n"
        "capabilities:\n"
        "  a: {description: internal api, http: {host: API.Internal, port: 8443, methods: [GET], path: /x}}\n"
        "roles: {}\n"
    )
    a = cat.capabilities["a"]
    assert a.description == "internal api"
    assert a.http is not None and a.http.host == "api.internal" and a.http.port == 8443
    assert dict(cat.roles) == {}


# (yaml text, the field the error must name, a phrase the message must carry)
INVALID = [
    pytest.param("capabilities: [\n", "line 2, column 1", "not valid YAML: expected the node content", id="not-yaml"),
    pytest.param("", "top level", "the catalog is empty", id="empty-file"),
    pytest.param("# nothing but a comment\n", "top level", "the catalog is empty", id="only-a-comment"),
    pytest.param("- a\n- b\n", "top level", "expected a mapping", id="top-level-list"),
    pytest.param("capabilitys: {}\n", "top level", "unknown key 'capabilitys'", id="typo-top-level"),
    pytest.param("roles: {}\n", "top level", "missing required key 'capabilities'", id="no-capabilities"),
    pytest.param("capabilities: {}\n", "capabilities", "non-empty mapping", id="empty-capabilities"),
    pytest.param("capabilities: [a, b]\n", "capabilities", "non-empty mapping", id="capabilities-list"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: /}}", "bad name!"),
                 "capability 'bad name!'", "capability names are", id="bad-capability-name"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: /}}", '"a\\n"'),
                 "capability 'a\\n'", "capability names are", id="capability-name-trailing-newline"),
    pytest.param(one_cap(""), "capability 'svc.call'", "expected a mapping, got nothing", id="capability-null"),
    pytest.param(one_cap("{}"), "capability 'svc.call'", "needs exactly one match", id="no-match"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: /}, mcp: {url: 'http://m/mcp', tool: t}}"),
                 "capability 'svc.call'", "needs exactly one match", id="two-matches"),
    pytest.param(one_cap("{htpp: {host: h.com, methods: [GET], path: /}}"),
                 "capability 'svc.call'", "unknown key 'htpp'", id="typo-htpp"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: /}, description: [x]}"),
                 "capability 'svc.call'.description", "expected a string", id="description-not-string"),
    pytest.param(one_cap("{http: {host: h.com, methds: [GET], path: /}}"),
                 "capability 'svc.call'.http", "unknown key 'methds'", id="typo-methds"),
    pytest.param(one_cap("{http: {host: h.com, path: /}}"),
                 "capability 'svc.call'.http", "missing required key 'methods'", id="missing-methods"),
    pytest.param(one_cap("{http: {methods: [GET], path: /}}"),
                 "capability 'svc.call'.http", "missing required key 'host'", id="missing-host"),
    pytest.param(one_cap("{http: [h.com]}"), "capability 'svc.call'.http", "expected a mapping", id="http-list"),
    pytest.param(one_cap("{http: {host: 'h.com/x', methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-with-path"),
    pytest.param(one_cap("{http: {host: 'h.com:443', methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-with-port"),
    pytest.param(one_cap("{http: {host: 'https://h.com', methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-is-url"),
    pytest.param(one_cap("{http: {host: 'h.com.', methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-trailing-dot"),
    pytest.param(one_cap("{http: {host: \"h.com\\n\", methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-trailing-newline"),
    pytest.param(one_cap("{http: {host: '', methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-empty"),
    pytest.param(one_cap("{http: {host: 42, methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.host", "not a host name", id="host-number"),
    pytest.param(one_cap("{http: {host: h.com, port: 0, methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.port", "not a TCP port", id="port-zero"),
    pytest.param(one_cap("{http: {host: h.com, port: 65536, methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.port", "not a TCP port", id="port-too-big"),
    pytest.param(one_cap("{http: {host: h.com, port: '443', methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.port", "not a TCP port", id="port-string"),
    pytest.param(one_cap("{http: {host: h.com, port: true, methods: [GET], path: /}}"),
                 "capability 'svc.call'.http.port", "not a TCP port", id="port-bool"),
    pytest.param(one_cap("{http: {host: h.com, methods: [], path: /}}"),
                 "capability 'svc.call'.http.methods", "non-empty list", id="methods-empty"),
    pytest.param(one_cap("{http: {host: h.com, methods: GET, path: /}}"),
                 "capability 'svc.call'.http.methods", "non-empty list", id="methods-not-list"),
    pytest.param(one_cap("{http: {host: h.com, methods: [get], path: /}}"),
                 "capability 'svc.call'.http.methods", "not an upper-case HTTP method", id="method-lowercase"),
    pytest.param(one_cap("{http: {host: h.com, methods: [\"GET\\n\"], path: /}}"),
                 "capability 'svc.call'.http.methods", "not an upper-case HTTP method", id="method-newline"),
    pytest.param(one_cap("{http: {host: h.com, methods: ['GET POST'], path: /}}"),
                 "capability 'svc.call'.http.methods", "not an upper-case HTTP method", id="method-space"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: 'v1/*'}}"),
                 "capability 'svc.call'.http.path", "starting with '/'", id="path-relative"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: '/v1?x=1'}}"),
                 "capability 'svc.call'.http.path", "starting with '/'", id="path-with-query"),
    pytest.param(one_cap("{http: {host: h.com, methods: [GET], path: 7}}"),
                 "capability 'svc.call'.http.path", "starting with '/'", id="path-number"),
    pytest.param(one_cap("{mcp: {url: 'http://m/mcp', tool: t, tools: [u]}}"),
                 "capability 'svc.call'.mcp", "unknown key 'tools'", id="mcp-unknown-key"),
    pytest.param(one_cap("{mcp: {url: 'http://m/mcp'}}"),
                 "capability 'svc.call'.mcp", "needs exactly one item", id="mcp-missing-tool"),
    pytest.param(one_cap("{mcp: {url: 'ftp://m/mcp', tool: t}}"),
                 "capability 'svc.call'.mcp.url", "http(s) URL", id="mcp-url-scheme"),
    pytest.param(one_cap("{mcp: {url: 'http:///mcp', tool: t}}"),
                 "capability 'svc.call'.mcp.url", "http(s) URL", id="mcp-url-no-host"),
    pytest.param(one_cap("{mcp: {url: 'http://m/mcp?k=v', tool: t}}"),
                 "capability 'svc.call'.mcp.url", "without a query", id="mcp-url-query"),
    pytest.param(one_cap("{mcp: {url: 'http://m:99999/mcp', tool: t}}"),
                 "capability 'svc.call'.mcp.url", "not a valid URL", id="mcp-url-port-range"),
    pytest.param(one_cap("{mcp: {url: 'http://m:abc/mcp', tool: t}}"),
                 "capability 'svc.call'.mcp.url", "not a valid URL", id="mcp-url-port-text"),
    pytest.param(one_cap("{mcp: {url: 'http://[oops/mcp', tool: t}}"),
                 "capability 'svc.call'.mcp.url", "not a valid URL", id="mcp-url-bad-ipv6"),
    pytest.param(one_cap("{mcp: {url: 8000, tool: t}}"),
                 "capability 'svc.call'.mcp.url", "http(s) URL", id="mcp-url-number"),
    pytest.param(one_cap("{mcp: {url: 'http://m/mcp', tool: ''}}"),
                 "capability 'svc.call'.mcp.tool", "expected a tool name", id="mcp-tool-empty"),
]


@pytest.mark.parametrize(("text", "where", "phrase"), INVALID)
def test_invalid_catalog_names_file_capability_and_field(text, where, phrase):
    err = refused(text, "deploy/catalog.yaml")
    assert err.message.startswith(f"deploy/catalog.yaml: {where}: "), err.message
    assert phrase in err.message, err.message
    assert err.details["source"] == "deploy/catalog.yaml"
    assert err.details["where"] == where
    assert "<unicode string>" not in err.message and "NoneType" not in err.message  # the file, in words people use


GOOD_CAP = "{http: {host: h.com, methods: [GET], path: /}}"

ROLE_INVALID = [
    pytest.param("roles: [a]\n", "roles", "expected a mapping", id="roles-list"),
    pytest.param("roles: {reader: [svc.call]}\n", "role 'reader'", "expected a mapping", id="role-list"),
    pytest.param("roles: {reader: {svc.call: direkt}}\n", "role 'reader'.svc.call",
                 "tier must be one of direct, approval, absent, got 'direkt'", id="bad-tier"),
    pytest.param("roles: {reader: {svc.call: DIRECT}}\n", "role 'reader'.svc.call",
                 "tier must be one of", id="tier-uppercase"),
    pytest.param("roles: {reader: {svc.call: null}}\n", "role 'reader'.svc.call",
                 "tier must be one of", id="tier-null"),
    pytest.param("roles: {reader: {svc.cal: direct}}\n", "role 'reader'.svc.cal",
                 "names a capability that is not in the catalog", id="unknown-capability"),
]


@pytest.mark.parametrize(("roles", "where", "phrase"), ROLE_INVALID)
def test_invalid_role(roles, where, phrase):
    err = refused(one_cap(GOOD_CAP) + roles)
    assert err.message.startswith(f"cat.yaml: {where}: "), err.message
    assert phrase in err.message, err.message


def test_role_may_name_every_tier_including_absent():
    cat = parse_catalog(one_cap(GOOD_CAP) + "roles: {none: {svc.call: absent}, all: {svc.call: approval}}\n")
    assert cat.role("none") == {"svc.call": "absent"}
    assert cat.role("all") == {"svc.call": "approval"}


def test_unknown_role_and_capability_are_refused(catalog):
    with pytest.raises(UnknownCapability) as info:
        catalog.role("admin")
    assert info.value.code == UNKNOWN_CAPABILITY
    assert "admin" in info.value.message and "researcher" in info.value.message
    with pytest.raises(UnknownCapability) as info:
        catalog.require(["llm.openai", "llm.anthropic"])
    assert info.value.code == UNKNOWN_CAPABILITY
    assert info.value.details["capability"] == "llm.anthropic"
    catalog.require(["llm.openai", "mail.send"])  # known names pass


def test_role_returns_a_copy(catalog):
    catalog.role("researcher")["mail.send"] = "direct"
    assert catalog.role("researcher")["mail.send"] == "approval"


# -- hashing ---------------------------------------------------------------------------------------
def test_hash_is_sha256_of_canonical_json(catalog):
    """The hash is part of every grant, so its definition is pinned here, independently of the code."""
    canonical = {
        "capabilities": {
            "github.issues.read": {"http": {"host": "api.github.com", "methods": ["GET"],
                                            "path": "/repos/*/*/issues*"}},
            "github.issues.write": {"http": {"host": "api.github.com", "methods": ["POST", "PATCH"],
                                             "path": "/repos/*/*/issues*"}},
            "llm.openai": {"http": {"host": "api.openai.com", "methods": ["POST"], "path": "/v1/*"}},
            "mail.send": {"mcp": {"url": "http://mail-mcp.internal:8000/mcp", "tool": "send_email"}},
        },
        "roles": {"researcher": {"github.issues.read": "direct", "llm.openai": "direct", "mail.send": "approval"}},
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert catalog.hash == "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_hash_is_stable_across_parses(catalog):
    assert parse_catalog(DESIGN_CATALOG).hash == catalog.hash
    assert parse_catalog(DESIGN_CATALOG, "elsewhere.yaml").hash == catalog.hash  # the file name is not content


def test_hash_ignores_key_order_and_formatting(catalog):
    reordered = textwrap.dedent("""\
        # same catalog, block style, keys and capabilities in another order
        roles:
          researcher:
            mail.send: approval
            llm.openai: direct
            github.issues.read: direct
        capabilities:
          mail.send:
            mcp:
              tool: send_email
              url: http://mail-mcp.internal:8000/mcp
          llm.openai:
            http: {path: "/v1/*", methods: [POST], host: API.OpenAI.com}
          github.issues.write:
            http:
              methods:
                - POST
                - PATCH
              path: '/repos/*/*/issues*'
              host: api.github.com
          github.issues.read:
            http: {methods: [GET], host: api.github.com, path: "/repos/*/*/issues*"}
        """)
    assert parse_catalog(reordered).hash == catalog.hash


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param("methods: [GET]", "methods: [GET, HEAD]", id="method-added"),
        pytest.param("/v1/*", "/v2/*", id="path"),
        pytest.param("host: api.openai.com", "host: api.openai.com, port: 443", id="port-added"),
        pytest.param("tool: send_email", "tool: send_mail", id="mcp-tool"),
        pytest.param("mail.send: approval}", "mail.send: direct}", id="role-tier"),
        pytest.param("llm.openai:          {", "llm.openai2:         {", id="capability-renamed"),
        pytest.param("send_email}}", "send_email}, description: outbound mail}", id="description"),
    ],
)
def test_hash_changes_with_content(catalog, old, new):
    assert old in DESIGN_CATALOG
    changed = DESIGN_CATALOG.replace(old, new, 1)
    if "llm.openai2" in changed:
        changed = changed.replace("llm.openai: direct", "llm.openai2: direct")
    assert parse_catalog(changed).hash != catalog.hash


# -- HTTP matching ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("host", "port", "method", "path", "expected"),
    [
        ("api.github.com", 443, "GET", "/repos/o/r/issues", ["github.issues.read"]),
        ("api.github.com", 443, "GET", "/repos/o/r/issues/12/comments", ["github.issues.read"]),
        ("api.github.com", 443, "POST", "/repos/o/r/issues", ["github.issues.write"]),
        ("api.github.com", 443, "PATCH", "/repos/o/r/issues/3", ["github.issues.write"]),
        ("api.github.com", 443, "DELETE", "/repos/o/r/issues/3", []),
        ("api.github.com", 443, "get", "/repos/o/r/issues", ["github.issues.read"]),
        # host is compared case-insensitively, a trailing root dot is the same name
        ("API.GitHub.COM", 443, "GET", "/repos/o/r/issues", ["github.issues.read"]),
        ("api.github.com.", 443, "GET", "/repos/o/r/issues", ["github.issues.read"]),
        ("api.github.com.evil.com", 443, "GET", "/repos/o/r/issues", []),
        ("evil.com", 443, "GET", "/repos/o/r/issues", []),
        ("github.com", 443, "GET", "/repos/o/r/issues", []),
        # no port in the catalog: any port matches
        ("api.github.com", 8080, "GET", "/repos/o/r/issues", ["github.issues.read"]),
        # `*` runs across `/`
        ("api.github.com", 443, "GET", "/repos/org/team/nested/repo/issues", ["github.issues.read"]),
        ("api.openai.com", 443, "POST", "/v1/chat/completions", ["llm.openai"]),
        ("api.openai.com", 443, "POST", "/v1/", ["llm.openai"]),
        ("api.openai.com", 443, "POST", "/v1", []),
        ("api.openai.com", 443, "POST", "/v2/chat", []),
        ("api.openai.com", 443, "POST", "/x/v1/chat", []),
        # everything but `*` is literal: '.' is not a regex wildcard
        ("api.github.com", 443, "GET", "/repos/o/r/pulls", []),
        # the query is not part of the path, either way round
        ("api.github.com", 443, "GET", "/repos/o/r/issues?state=open&page=2", ["github.issues.read"]),
        ("api.openai.com", 443, "POST", "/admin?next=/v1/chat", []),
        ("api.github.com", 443, "GET", "/user?/repos/o/r/issues", []),
        ("api.github.com", 443, "GET", "/user#/repos/o/r/issues", []),
    ],
)
def test_match_http(catalog, host, port, method, path, expected):
    assert catalog.match_http(host, port, method, path) == expected


def test_glob_literal_characters_are_not_regex():
    cat = parse_catalog(one_cap("{http: {host: h.com, methods: [GET], path: '/a.b/(x)+[y]'}}"))
    assert cat.match_http("h.com", 80, "GET", "/a.b/(x)+[y]") == ["svc.call"]
    assert cat.match_http("h.com", 80, "GET", "/aXb/(x)+[y]") == []
    assert cat.match_http("h.com", 80, "GET", "/a.b/xx[y]") == []


def test_port_narrows_host():
    cat = parse_catalog(
        "capabilities:\n"
        "  admin: {http: {host: svc.internal, port: 9443, methods: [GET], path: '/*'}}\n"
        "  public: {http: {host: svc.internal, methods: [GET], path: '/public/*'}}\n"
    )
    assert cat.match_http("svc.internal", 9443, "GET", "/public/x") == ["admin", "public"]
    assert cat.match_http("svc.internal", 443, "GET", "/public/x") == ["public"]
    assert cat.match_http("svc.internal", 443, "GET", "/private") == []
    assert cat.match_http("svc.internal", 9443, "GET", "/private") == ["admin"]


def test_overlapping_capabilities_all_match_in_catalog_order():
    cat = parse_catalog(
        "capabilities:\n"
        "  z.broad: {http: {host: h.com, methods: [GET, POST], path: '/*'}}\n"
        "  a.narrow: {http: {host: h.com, methods: [GET], path: '/v1/*'}}\n"
    )
    assert cat.match_http("h.com", 443, "GET", "/v1/x") == ["z.broad", "a.narrow"]
    assert cat.match_http("h.com", 443, "POST", "/v1/x") == ["z.broad"]


TRAVERSALS = [
    "/v1/../admin",
    "/v1/./chat",
    "/v1/chat/..",
    "/v1/%2e%2e/admin",
    "/v1/%2E%2E/admin",
    "/v1/.%2e/admin",
    "/v1/%252e%252e/admin",
    "/v1/%2e/chat",
    "/v1/a%2fb",
    "/v1/a%2Fb",
    "/v1/a%252fb",
    "/v1/a%5cb",
    "/v1/a%255Cb",
    "/v1/a\\..\\admin",
    "/v1/a%00b",
    "v1/chat",
    "*",
    "",
    # issue 11: a fragment, path parameters, overlong UTF-8, fullwidth dots, IIS %u, deeper encodings
    "/v1/chat#frag",
    "/v1/#/../admin",
    "/v1/..;/admin",
    "/v1/..;jsessionid=0/admin",
    "/v1/%2e%2e;x=1/admin",
    "/v1/%c0%ae%c0%ae/admin",
    "/v1/%e0%80%ae/admin",
    "/v1/%ff/x",
    "/v1/\uff0e\uff0e/admin",
    "/v1/%ef%bc%8e%ef%bc%8e/admin",
    "/v1/\u2024\u2024/admin",
    "/v1/%u002e%u002e/admin",
    "/v1/%25252e%25252e/admin",
    "/v1/%2525252525252e/admin",
    "/v1/a%ef%bc%8fb",
    "/v1/a%09b",
    "/v1/. ./admin",
    "/v1/.../admin",
    "/v1/100%",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_paths_that_could_escape_the_glob_match_nothing(catalog, path):
    assert safe_path(path) is None
    # the glob "/v1/*" would match most of these as raw text; the catalog must refuse them anyway
    assert catalog.match_http("api.openai.com", 443, "POST", path) == []


@pytest.mark.parametrize(
    ("path", "clean"),
    [
        ("/v1/chat", "/v1/chat"),
        ("/v1/chat?x=../../etc", "/v1/chat"),
        ("/v1/chat;v=2", "/v1/chat;v=2"),
        ("/v1/a%25b", "/v1/a%25b"),
        ("/v1/a..b/c.d", "/v1/a..b/c.d"),
        ("/v1/.well-known/x", "/v1/.well-known/x"),
        ("/v1/caf%C3%A9", "/v1/caf%C3%A9"),
        ("/", "/"),
        ("//double", "//double"),
    ],
)
def test_safe_paths_pass_without_query(path, clean):
    assert safe_path(path) == clean


# -- MCP matching ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://mail-mcp.internal:8000/mcp", "http://mail-mcp.internal:8000/mcp"),
        ("http://mail-mcp.internal:8000/mcp/", "http://mail-mcp.internal:8000/mcp"),
        ("HTTP://Mail-MCP.Internal:8000/mcp", "http://mail-mcp.internal:8000/mcp"),
        ("http://mail-mcp.internal:8000/mcp?session=1", "http://mail-mcp.internal:8000/mcp"),
        ("http://mail-mcp.internal/mcp", None),  # port 80, not 8000
        ("https://mail-mcp.internal:8000/mcp", None),
        ("http://mail-mcp.internal:8000/mcp/extra", None),
        ("http://mail-mcp.internal:8000/MCP", None),  # paths are case-sensitive
        ("http://other.internal:8000/mcp", None),
    ],
)
def test_mcp_server_normalizes(catalog, url, expected):
    assert catalog.mcp_server(url) == expected


def test_default_port_is_made_explicit():
    assert normalize_url("https://tools.example/mcp/") == "https://tools.example:443/mcp"
    assert normalize_url("http://tools.example") == "http://tools.example:80/"
    cat = parse_catalog(one_cap("{mcp: {url: 'https://Tools.Example/mcp/', tool: search}}"))
    server = "https://tools.example:443/mcp"
    assert cat.mcp_server("https://tools.example:443/mcp") == server
    assert cat.mcp_server("https://tools.example/mcp") == server
    assert cat.mcp_server("http://tools.example/mcp") is None
    assert cat.match_mcp(server, "search") == ["svc.call"]


def test_match_mcp_by_server_and_tool(catalog):
    server = "http://mail-mcp.internal:8000/mcp"
    assert catalog.match_mcp(server, "send_email") == ["mail.send"]
    assert catalog.match_mcp(server, "delete_all_email") == []
    assert catalog.match_mcp("http://mail-mcp.internal:8001/mcp", "send_email") == []
    assert catalog.mcp_tools(server) == {"send_email": ["mail.send"]}
    assert catalog.mcp_tools("http://elsewhere:80/mcp") == {}
    # an MCP server is not an HTTP capability: raw HTTP to it matches nothing
    assert catalog.match_http("mail-mcp.internal", 8000, "POST", "/mcp") == []


def test_mcp_tools_groups_capabilities():
    cat = parse_catalog(
        "capabilities:\n"
        "  fs.read: {mcp: {url: 'http://fs:9000/mcp', tool: read_file}}\n"
        "  fs.read.audited: {mcp: {url: 'http://fs:9000/mcp/', tool: read_file}}\n"
        "  fs.write: {mcp: {url: 'http://fs:9000/mcp', tool: write_file}}\n"
    )
    assert cat.mcp_tools("http://fs:9000/mcp") == {
        "read_file": ["fs.read", "fs.read.audited"], "write_file": ["fs.write"],
    }


# -- knows_host ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("host", "port", "known"),
    [
        ("api.github.com", 443, True),
        ("api.github.com", 80, True),  # no port in the catalog: any port
        ("API.GITHUB.COM.", 443, True),
        ("mail-mcp.internal", 8000, True),
        ("mail-mcp.internal", 80, False),  # the MCP server's URL fixes its port
        ("mail-mcp.internal", 443, False),
        ("github.com", 443, False),
        ("evil.com", 443, False),
    ],
)
def test_knows_host(catalog, host, port, known):
    assert catalog.knows_host(host, port) is known


def test_knows_host_honours_port_narrowing_and_default_ports():
    cat = parse_catalog(
        "capabilities:\n"
        "  a: {http: {host: svc.internal, port: 9443, methods: [GET], path: '/*'}}\n"
        "  b: {mcp: {url: 'https://tools.example/mcp', tool: t}}\n"
    )
    assert cat.knows_host("svc.internal", 9443)
    assert not cat.knows_host("svc.internal", 443)
    assert cat.knows_host("tools.example", 443)
    assert not cat.knows_host("tools.example", 80)


def test_ipv6_literals_match_however_they_are_spelled() -> None:
    """mitmproxy gives an IPv6 destination bare ("::1"), a catalog or URL bracketed and in any spelling."""
    cat = parse_catalog(one_cap('{http: {host: "[0:0::1]", port: 8080, methods: [GET], path: "/v6*"}}')
                        + "  svc.mcp: {mcp: {url: 'http://[::0:1]:9000/mcp', tool: t}}\n")
    assert cat.capabilities["svc.call"].http.host == "[::1]"
    assert cat.match_http("::1", 8080, "GET", "/v6/x") == ["svc.call"]
    assert cat.match_http("0::1", 8080, "GET", "/v6/x") == ["svc.call"]
    assert cat.match_http("::2", 8080, "GET", "/v6/x") == []
    assert cat.match_http("::1", 8081, "GET", "/v6/x") == []
    assert cat.knows_host("::1", 8080) and cat.knows_host("::1", 9000) and not cat.knows_host("::1", 9001)
    assert cat.mcp_server("http://[::1]:9000/mcp/") == "http://[::1]:9000/mcp"
    assert normalize_url("http://[0:0::1]/x") == "http://[::1]:80/x"


@pytest.mark.parametrize("host", ["[:::]", "[1::2::3]", "[::g]"])
def test_a_bracketed_host_that_is_not_an_ipv6_address_is_refused(host: str) -> None:
    err = refused(one_cap(f'{{http: {{host: "{host}", methods: [GET], path: "/"}}}}'))
    assert "not a host name" in str(err)


# -- MCP items beyond tools --------------------------------------------------------------------------------
ITEMS = """\
capabilities:
  fs.read:     {mcp: {url: "http://fs:9000/mcp", tool: read_file}}
  docs.public: {mcp: {url: "http://fs:9000/mcp", resource: "docs://public/*"}}
  docs.page:   {mcp: {url: "http://fs:9000/mcp/", resource: "docs://public/{page}"}}
  users:       {mcp: {url: "http://fs:9000/mcp", resource: "users://{id}/profile"}}
  readme:      {mcp: {url: "http://fs:9000/mcp", resource: "file:///srv/README.md"}}
  greet:       {mcp: {url: "http://fs:9000/mcp", prompt: greet}}
  fs.logging:  {mcp: {url: "http://fs:9000/mcp", logging: true}}
  fs.complete: {mcp: {url: "http://fs:9000/mcp", completion: true}}
  fs.subs:     {mcp: {url: "http://fs:9000/mcp", subscriptions: true}}
  other.log:   {mcp: {url: "http://other:9000/mcp", logging: true}}
"""
FS = "http://fs:9000/mcp"


@pytest.fixture(scope="module")
def items():
    return parse_catalog(ITEMS, "items.yaml")


def test_every_kind_of_mcp_item_parses(items):
    kinds = {name: (c.mcp.kind, c.mcp.name) for name, c in items.capabilities.items()}
    assert kinds["docs.public"] == ("resource", "docs://public/*")
    assert kinds["greet"] == ("prompt", "greet") and kinds["fs.logging"] == ("logging", "")
    assert items.capabilities["fs.read"].mcp.tool == "read_file" and items.capabilities["greet"].mcp.tool is None
    assert items.to_dict()["capabilities"]["fs.subs"] == {"mcp": {"url": FS, "subscriptions": True}}
    assert items.to_dict()["capabilities"]["docs.page"] == {
        "mcp": {"url": "http://fs:9000/mcp/", "resource": "docs://public/{page}"}}
    assert items.mcp_server("http://fs:9000/mcp") == FS


@pytest.mark.parametrize(("uri", "expected"), [
    ("docs://public/readme", ["docs.public", "docs.page"]),
    ("docs://public/a/b", ["docs.public", "docs.page"]),  # a template's {page} reads as '*': '/' included
    ("users://7/profile", ["users"]),
    ("users://7/settings", []),
    ("file:///srv/README.md", ["readme"]),
    ("file:///srv/README.mdx", []),
    ("FILE:///srv/README.md", []),  # compared as written: fail closed
    ("docs://private/plan", []),
    ("docs://public/../private/plan", []),  # dot segments never match
    ("docs://public/%2e%2e/private/plan", []),
    ("docs://public/a%2fb", []),  # an encoded slash
    ("docs://public/a\\b", []),
    ("docs://public/x#frag", []),
    ("docs://public/\x00", []),
    ("no-scheme/public/x", []),
])
def test_resources_match_by_uri_glob_or_template(items, uri, expected):
    assert items.match_resource(FS, uri) == expected


@pytest.mark.parametrize(("template", "expected"), [
    ("docs://public/{page}", ["docs.public", "docs.page"]),
    ("docs://public/{section}/{page}", ["docs.public", "docs.page"]),
    ("users://{id}/profile", ["users"]),
    ("users://{id}", []),  # would expand to URIs no capability admits
    ("docs://{area}/x", []),
    ("docs://public/../{x}", []),
    ("docs://public/{unclosed", []),
])
def test_resource_templates_are_granted_only_when_every_expansion_is(items, template, expected):
    assert items.match_resource_template(FS, template) == expected


def test_prompts_and_plumbing_match_by_name(items):
    assert items.match_mcp_item(FS, "prompt", "greet") == ["greet"]
    assert items.match_mcp_item(FS, "prompt", "read_file") == []  # a tool's name is not a prompt's
    assert items.match_mcp_item(FS, "tool", "greet") == []
    assert items.match_mcp_item(FS, "logging") == ["fs.logging"]
    assert items.match_mcp_item("http://other:9000/mcp", "logging") == ["other.log"]
    assert items.match_mcp_item("http://other:9000/mcp", "completion") == []
    assert items.mcp_tools(FS) == {"read_file": ["fs.read"]}
    assert items.mcp_named(FS, "prompt") == {"greet": ["greet"]}
    assert sorted(items.mcp_capabilities(FS)) == sorted(n for n in items.names() if n != "other.log")
    assert items.knows_host("other", 9000)


MCP_INVALID = [
    ("{mcp: {url: 'http://m/mcp', tool: a, prompt: b}}", "capability 'svc.call'.mcp", "needs exactly one item"),
    ("{mcp: {url: 'http://m/mcp', prompt: ''}}", "capability 'svc.call'.mcp.prompt", "expected a prompt name"),
    ("{mcp: {url: 'http://m/mcp', logging: yes please}}", "capability 'svc.call'.mcp.logging", "expected true"),
    ("{mcp: {url: 'http://m/mcp', completion: false}}", "capability 'svc.call'.mcp.completion", "expected true"),
    ("{mcp: {url: 'http://m/mcp', resource: 'no/scheme/*'}}", "capability 'svc.call'.mcp.resource", "with a scheme"),
    ("{mcp: {url: 'http://m/mcp', resource: 'docs://a/../b'}}", "capability 'svc.call'.mcp.resource", "dot segm"),
    ("{mcp: {url: 'http://m/mcp', resource: 'docs://{x'}}", "capability 'svc.call'.mcp.resource", "braces"),
    ("{mcp: {url: 'http://m/mcp', resource: 7}}", "capability 'svc.call'.mcp.resource", "expected a resource"),
    ("{mcp: {url: 'http://m/mcp', resource: 'docs://" + "a" * 1100 + "'}}", "capability 'svc.call'.mcp.resource",
     "at most 1024"),
    ("{mcp: {url: 'http://m/mcp', tools: a}}", "capability 'svc.call'.mcp", "unknown key 'tools'"),
]


@pytest.mark.parametrize(("spec", "where", "phrase"), MCP_INVALID)
def test_invalid_mcp_items_name_the_field(spec, where, phrase):
    err = refused(one_cap(spec), "deploy/catalog.yaml")
    assert err.message.startswith(f"deploy/catalog.yaml: {where}"), err.message
    assert phrase in err.message, err.message


def test_every_item_of_one_server_names_the_same_credential():
    text = ("credentials:\n  c: {header: Authorization}\n"
            "capabilities:\n"
            "  t: {mcp: {url: 'http://m/mcp', tool: t}, credential: c}\n"
            "  r: {mcp: {url: 'http://m/mcp', resource: 'docs://*'}}\n")
    assert "must name the same credential" in refused(text).message
