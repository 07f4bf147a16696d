"""The release gate: glob inclusion proved against brute force, `tether audit diff` on a table of catalog
pairs through the CLI on files, version-1 input, the offline surface, and the issue's own example end to end
against a real control plane restarted on a widened catalog."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import mint_root
from tether.capability.errors import CatalogError
from tether.capability.glob import MAX_GLOB, Budget, bound, compare, included, witness
from tether.capability.kinds.http import HttpMatch
from tether.cli.main import main
from tether.controlplane import audit

from .harness import ADMIN_TOKEN, PYTHON, ControlPlaneProcess, prepare_controlplane


# -- glob inclusion, against brute force --------------------------------------------------------------------
def admits(glob: str, path: str) -> bool:
    """The catalog's own matcher, as the sidecar runs it."""
    return HttpMatch("h", ("GET",), glob).matches("h", 80, "GET", path)


# Globs over a small alphabet so that counterexamples are short and brute force finds them; the strings
# tried add a letter neither glob uses ("c"), which a `*` can match and a literal cannot.
GLOBS = st.text(alphabet="ab/*", max_size=6)
BRUTE_ALPHABET = "ab/c"
BRUTE_MAX = 7
ALL_STRINGS = ["".join(p) for n in range(BRUTE_MAX + 1) for p in itertools.product(BRUTE_ALPHABET, repeat=n)]


@settings(max_examples=600, deadline=None)
@given(GLOBS, GLOBS)
def test_glob_inclusion_agrees_with_brute_force(new: str, old: str) -> None:
    example = witness(new, old)
    if example is not None:
        # A witness is real: the new glob admits it and the old refuses it.
        assert admits(new, example) and not admits(old, example), (new, old, example)
        assert not included(new, old)
    counter = next((s for s in ALL_STRINGS if admits(new, s) and not admits(old, s)), None)
    if example is None:
        assert counter is None, f"{new!r} admits {counter!r} which {old!r} refuses, yet judged included"
        assert included(new, old)
    elif len(example) <= BRUTE_MAX:
        # Shortest: brute force (shortest first) finds one of the same length.
        assert counter is not None and len(counter) == len(example), (new, old, example, counter)


@settings(max_examples=300, deadline=None)
@given(GLOBS)
def test_a_glob_includes_itself_and_is_included_in_star(glob: str) -> None:
    assert included(glob, glob) and included(glob, "*")


@pytest.mark.parametrize(("new", "old", "inside"), [
    ("/public/*", "/*", True),
    ("/*", "/public/*", False),
    ("/repos/*/issues", "/repos/*", True),
    ("/repos/*", "/repos/*/issues", False),
    ("/a/**", "/a/*", True),          # the same language, spelt differently
    ("/a/*", "/a/**", True),
    ("/a*b*c", "/a*c", True),
    ("/a*c", "/a*b*c", False),
    ("/x*/y", "/x/*", False),        # "/xz/y" is not under "/x/"
    ("*a*a*", "*a*", True),
    ("*a*", "*a*a*", False),
])
def test_glob_inclusion_examples(new: str, old: str, inside: bool) -> None:
    assert included(new, old) is inside
    if not inside:
        example = witness(new, old)
        assert example is not None and admits(new, example) and not admits(old, example)


@settings(max_examples=300, deadline=None)
@given(GLOBS)
def test_the_matcher_agrees_with_a_regex(glob: str) -> None:
    """The catalog matches greedily (a regex backtracks exponentially on ``*a*b*a*b...``); on short strings
    a regex is a fine oracle for it."""
    regex = re.compile(".*".join(re.escape(part) for part in glob.split("*")), re.DOTALL)
    for s in ALL_STRINGS:
        assert admits(glob, s) is (regex.fullmatch(s) is not None), (glob, s)


def hostile(n: int) -> tuple[str, str]:
    """The reviewer's pair: each side's subset construction is large, their product exponential."""
    return "/" + "*a*b" * n + "*", "/" + "*ab" * n + "*c"


@pytest.mark.parametrize("n", [80, 110])
def test_hostile_globs_are_decided_within_a_polynomial_number_of_states(n: int) -> None:
    new, old = hostile(n)
    verdict = compare(new, old)
    # The shortest string new admits is "/abab...ab" (2n+1 characters); old wants 2n+2 at least, ending in c.
    assert not verdict.included and verdict.shortest and verdict.example == "/" + "ab" * n
    assert admits(new, verdict.example) and not admits(old, verdict.example)
    # Positions of new times the states of the automaton of what old refuses: the search cannot visit more
    # (the product of the two subset constructions it replaced needs exponentially many here).
    assert 0 < verdict.visited <= bound(new, old)
    assert included(old, new) and witness(old, new) is None  # the other way round: "/xabxab...xabxc"


def test_a_spent_budget_still_gives_a_real_witness() -> None:
    new, old = hostile(110)
    budget = Budget(steps=1000)
    verdict = compare(new, old, budget)
    assert not verdict.included and not verdict.shortest and budget.left < 0
    assert verdict.example is not None and admits(new, verdict.example) and not admits(old, verdict.example)
    assert compare("/*", "/public/*", budget).example is not None  # the budget is shared: spent stays spent


def test_hostile_pair_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new, old = hostile(80)
    (tmp_path / "old.json").write_text(json.dumps(hostile_surface(old, 1)))
    (tmp_path / "new.json").write_text(json.dumps(hostile_surface(new, 1)))
    code, text, _ = run_cli(capsys, "audit", "diff", str(tmp_path / "old.json"), str(tmp_path / "new.json"))
    assert code == 1 and f"admits {'/' + 'ab' * 80!r}, which the old path refused" in text, text
    code, text, _ = run_cli(capsys, "audit", "diff", str(tmp_path / "new.json"), str(tmp_path / "old.json"))
    assert code == 0 and "no capability widened" in text, text


def test_overlong_globs_are_refused_by_the_catalog_and_counted_as_widened_by_the_gate() -> None:
    long = "/" + "a" * MAX_GLOB
    caps = {"web": {"http": {"host": "a.example", "methods": ["GET"], "path": long}}}
    with pytest.raises(CatalogError, match=f"at most {MAX_GLOB}"):
        parse_catalog(catalog_text(caps))
    parse_catalog(catalog_text({"web": {"http": {"host": "a.example", "methods": ["GET"], "path": long[:-1]}}}))
    found, _ = audit.diff(hostile_surface(long, 1), hostile_surface(long + "b", 1))
    assert [(w.kind, w.detail.startswith("not compared, counted as widened")) for w in found] == [(audit.PATH, True)]


# -- audit diff through the CLI, on a table of catalog pairs ---------------------------------------------------
BASE = {
    "web": {"http": {"host": "api.example.com", "port": 443, "methods": ["GET"], "path": "/public/*"}},
    "anyport": {"http": {"host": "api.example.com", "methods": ["GET", "POST"], "path": "/any"}},
    "tool": {"mcp": {"url": "http://tools:9000/mcp", "tool": "search"}},
    "spare": {"http": {"host": "spare.example.com", "methods": ["GET"], "path": "/x"}},
}
BASE_GRANTS = {"web": "direct", "anyport": "direct", "tool": "approval"}


def with_cap(name: str, **http_or_mcp: object) -> dict:
    caps = json.loads(json.dumps(BASE))
    kind = "http" if "http" in caps[name] else "mcp"
    caps[name][kind].update(http_or_mcp)
    return caps


def catalog_text(caps: dict, roles: dict | None = None) -> str:
    return json.dumps({"capabilities": caps, "roles": roles or {}})  # YAML is a superset of JSON


# (case, new catalog's capabilities, new grants, widenings expected as (capability, kind))
CASES = [
    ("path /public/* -> /*", with_cap("web", path="/*"), BASE_GRANTS, [("web", audit.PATH)]),
    ("path to a sibling", with_cap("web", path="/private/*"), BASE_GRANTS, [("web", audit.PATH)]),
    ("method added", with_cap("web", methods=["GET", "DELETE"]), BASE_GRANTS, [("web", audit.METHODS)]),
    ("host changed", with_cap("web", host="evil.example.com"), BASE_GRANTS, [("web", audit.HOST)]),
    ("port changed", with_cap("web", port=8443), BASE_GRANTS, [("web", audit.PORT)]),
    ("port dropped", {**BASE, "web": {"http": {k: v for k, v in BASE["web"]["http"].items() if k != "port"}}},
     BASE_GRANTS, [("web", audit.PORT)]),
    ("mcp url changed", with_cap("tool", url="http://other:9000/mcp"), BASE_GRANTS, [("tool", audit.MCP_URL)]),
    ("mcp tool changed", with_cap("tool", tool="delete_all"), BASE_GRANTS, [("tool", audit.MCP_TOOL)]),
    ("http became mcp", {**BASE, "web": {"mcp": {"url": "http://tools:9000/mcp", "tool": "x"}}}, BASE_GRANTS,
     [("web", audit.WIRE)]),
    ("tier raised", BASE, {**BASE_GRANTS, "tool": "direct"}, [("tool", audit.TIER)]),
    ("absent granted", BASE, {**BASE_GRANTS, "spare": "approval"}, [("spare", audit.TIER)]),
    ("capability added", {**BASE, "new.cap": {"http": {"host": "a.example", "methods": ["GET"], "path": "/"}}},
     {**BASE_GRANTS, "new.cap": "direct"}, [("new.cap", audit.CAPABILITY_ADDED)]),
    ("two at once", with_cap("web", path="/*", methods=["GET", "POST"]), BASE_GRANTS,
     [("web", audit.METHODS), ("web", audit.PATH)]),
    # narrowing and reformatting pass
    ("path narrowed", with_cap("web", path="/public/docs/*"), BASE_GRANTS, []),
    ("path respelt", with_cap("web", path="/public/**"), BASE_GRANTS, []),
    ("methods reordered", with_cap("anyport", methods=["POST", "GET"]), BASE_GRANTS, []),
    ("method removed", with_cap("anyport", methods=["GET"]), BASE_GRANTS, []),
    ("port pinned", with_cap("anyport", port=443), BASE_GRANTS, []),
    ("host case", with_cap("web", host="API.Example.COM"), BASE_GRANTS, []),
    ("mcp url respelt", with_cap("tool", url="http://TOOLS:9000/mcp/"), BASE_GRANTS, []),
    ("tier lowered", BASE, {**BASE_GRANTS, "web": "approval"}, []),
    ("grant dropped", BASE, {k: v for k, v in BASE_GRANTS.items() if k != "tool"}, []),
    ("capability removed", {k: v for k, v in BASE.items() if k != "spare"}, BASE_GRANTS, []),
    ("ungranted capability widened", with_cap("spare", path="/*"), BASE_GRANTS, []),
    ("ungranted capability added", {**BASE, "other": BASE["spare"]}, BASE_GRANTS, []),
    ("description added", {**BASE, "web": {**BASE["web"], "description": "public pages"}}, BASE_GRANTS, []),
]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def offline_surface(capsys: pytest.CaptureFixture[str], d: Path, name: str, caps: dict, grants: dict) -> Path:
    (d / f"{name}.yaml").write_text(catalog_text(caps, {"bot": grants}))
    code, out, err = run_cli(capsys, "audit", "surface", "--catalog", str(d / f"{name}.yaml"),
                             "--role", "bot=bot", "--json")
    assert code == 0, err
    (d / f"{name}.json").write_text(out)
    return d / f"{name}.json"


@pytest.mark.parametrize(("case", "caps", "grants", "expected"), CASES, ids=[c[0] for c in CASES])
def test_audit_diff_table(case: str, caps: dict, grants: dict, expected: list, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    old = offline_surface(capsys, tmp_path, "old", BASE, BASE_GRANTS)
    new = offline_surface(capsys, tmp_path, "new", caps, grants)
    code, out, _ = run_cli(capsys, "audit", "diff", str(old), str(new), "--json")
    report = json.loads(out)
    found = sorted((w["capability"], w["kind"]) for w in report["widenings"])
    assert found == sorted(expected), out
    assert code == (1 if expected else 0) and report["widened"] is bool(expected)
    assert all(w["agent"] == "bot" and "old" in w and "new" in w for w in report["widenings"])
    code, text, _ = run_cli(capsys, "audit", "diff", str(old), str(new))
    assert code == (1 if expected else 0)
    for cap, _kind in expected:
        assert f"WIDENED bot: {cap} " in text
    assert ("no capability widened" in text) is (not expected)


def test_diff_names_old_and_new_and_a_witness(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = offline_surface(capsys, tmp_path, "old", BASE, BASE_GRANTS)
    new = offline_surface(capsys, tmp_path, "new", with_cap("web", path="/*"), BASE_GRANTS)
    code, text, _ = run_cli(capsys, "audit", "diff", str(old), str(new))
    assert code == 1
    assert 'WIDENED bot: web path widened: "/public/*" -> "/*"; admits \'/\', which the old path refused' in text
    report = json.loads(run_cli(capsys, "audit", "diff", str(old), str(new), "--json")[1])
    assert report["widenings"] == [{"agent": "bot", "capability": "web", "kind": "path_widened", "old": "/public/*",
                                    "new": "/*", "detail": "admits '/', which the old path refused"}]


def test_agent_added_and_budgets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A new agent with a grant widens; budgets (object-shaped caps) raised or removed widen, lowered pass."""
    catalog = parse_catalog(catalog_text(BASE))

    def doc(grants: dict) -> Path:
        path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(audit.surface(catalog, {a: [caps] for a, caps in grants.items()})))
        return path

    limited = {"web": {"tier": "direct", "calls": 10, "per_minute": 5}}
    base = doc({"bot": limited})
    assert json.loads(base.read_text())["agents"]["bot"]["web"]["budget"] == {"calls": 10, "per_minute": 5}
    cases = [
        ({"bot": limited, "new": {"tool": "approval"}}, [("new", "tool", audit.AGENT_ADDED)]),
        ({"bot": limited, "idle": {"web": "absent"}}, []),
        ({"bot": {"web": {"tier": "direct", "calls": 11, "per_minute": 5}}}, [("bot", "web", audit.BUDGET)]),
        ({"bot": {"web": {"tier": "direct", "calls": 10}}}, [("bot", "web", audit.BUDGET)]),
        ({"bot": {"web": "direct"}}, [("bot", "web", audit.BUDGET)]),
        ({"bot": {"web": {"tier": "direct", "calls": 3, "per_minute": 1}}}, []),
        ({"bot": {"web": {"tier": "approval", "calls": 10, "per_minute": 5}}}, []),
    ]
    for grants, expected in cases:
        code, out, _ = run_cli(capsys, "audit", "diff", str(base), str(doc(grants)), "--json")
        found = [(w["agent"], w["capability"], w["kind"]) for w in json.loads(out)["widenings"]]
        assert found == expected, (grants, out)
        assert code == (1 if expected else 0)
    # and the other way: a budget added where there was none narrows
    code, _, _ = run_cli(capsys, "audit", "diff", str(doc({"bot": {"web": "direct"}})), str(base))
    assert code == 0


def test_version_one_files_still_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v1 = {"catalog": "sha256:old", "agents": {"bot": {"web": "approval", "tool": "approval", "spare": "absent"}}}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    v2 = offline_surface(capsys, tmp_path, "v2", BASE, BASE_GRANTS)
    code, text, _ = run_cli(capsys, "audit", "diff", str(tmp_path / "v1.json"), str(v2))
    assert code == 1
    assert "WIDENED bot: web approval -> direct (tier raised)" in text
    assert "WIDENED bot: anyport added, granted direct" in text
    assert "version 1" in text and "tool" not in text.split("WIDENED", 1)[1]
    narrower = {"catalog": "sha256:old", "agents": {"bot": {"web": "absent", "tool": "approval"}}}
    (tmp_path / "v1b.json").write_text(json.dumps(narrower))
    assert run_cli(capsys, "audit", "diff", str(tmp_path / "v1.json"), str(tmp_path / "v1b.json"))[0] == 0
    assert run_cli(capsys, "audit", "diff", str(v2), str(tmp_path / "v1b.json"))[0] == 0


@pytest.mark.parametrize("content", ["[1, 2", "[]", '{"agents": {"a": {"x": "root"}}}',
                                     '{"version": 3, "agents": {}}',
                                     '{"version": 2, "agents": {"a": {"x": {"tier": "direct", "wire": {"ftp": 1}}}}}'])
def test_unreadable_input_exits_2(content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ok.json").write_text('{"version": 2, "catalog": "c", "agents": {}}')
    (tmp_path / "bad.json").write_text(content)
    code, _, err = run_cli(capsys, "audit", "diff", str(tmp_path / "ok.json"), str(tmp_path / "bad.json"))
    assert code == 2 and "tether.bad_request" in err and "bad.json" in err
    code, _, err = run_cli(capsys, "audit", "diff", str(tmp_path / "ok.json"), str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read surface" in err


# -- the offline surface from chains ------------------------------------------------------------------------
def test_offline_surface_from_chains_verified_against_trust(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "catalog.yaml").write_text(catalog_text(BASE))
    catalog = parse_catalog(catalog_text(BASE))
    signing, stranger = keys.generate(), keys.generate()
    (tmp_path / "cp.pub").write_bytes(keys.public_pem(signing.public_key()))
    for name, key in (("good", signing), ("forged", stranger)):
        wire = mint_root(key, agent=f"{name}-bot", subject_key=keys.generate().public_key(),
                         caps={"web": "direct", "tool": "approval"}, now=1000.0, ttl_s=60, depth=1, catalog=catalog)
        (tmp_path / f"{name}.chain").write_text(wire + "\n")
    base = ["audit", "surface", "--catalog", str(tmp_path / "catalog.yaml"), "--json"]
    trust = ["--trust", str(tmp_path / "cp.pub")]
    # expired long ago: the offline surface reads what the chain grants, not whether it is live today
    code, out, err = run_cli(capsys, *base, "--chain", str(tmp_path / "good.chain"), *trust, "--role", "other=missing")
    assert code == 2 and "role 'missing'" in err
    code, out, err = run_cli(capsys, *base, "--chain", str(tmp_path / "good.chain"), *trust)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["version"] == 2 and doc["catalog"] == catalog.hash
    assert doc["agents"]["good-bot"]["web"] == {"tier": "direct", "budget": None, "wire": {"http": {
        "host": "api.example.com", "port": 443, "methods": ["GET"], "path": "/public/*"}}}
    assert doc["agents"]["good-bot"]["tool"]["wire"] == {"mcp": {"url": "http://tools:9000/mcp", "tool": "search"}}
    assert doc["agents"]["good-bot"]["spare"]["tier"] == "absent"
    code, _, err = run_cli(capsys, *base, "--chain", str(tmp_path / "forged.chain"), *trust)
    assert code == 2 and "tether.chain_invalid" in err
    code, out, _ = run_cli(capsys, *base, "--chain", str(tmp_path / "forged.chain"))  # unverified when no --trust
    assert code == 0 and json.loads(out)["agents"]["forged-bot"]["web"]["tier"] == "direct"
    code, _, err = run_cli(capsys, *base, "--chain", str(tmp_path / "good.chain"), "--agent", "nobody")
    assert code == 2 and "nobody" in err


# -- the issue's example, end to end ----------------------------------------------------------------------------
@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path / "cp", 1, 2, 3)
    proc.catalog_path.write_text(
        "capabilities:\n"
        "  site.read: {http: {host: api.example.com, methods: [GET], path: '/public/*'}}\n"
        "  mcp.search: {mcp: {url: 'http://tools:9000/mcp', tool: search}}\n")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def tether(cp: ControlPlaneProcess, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tether", *args], cwd=cwd, env=cp.env(), capture_output=True,
                          text=True, timeout=60)


def test_widened_path_served_by_a_restarted_control_plane_fails_the_gate(cp: ControlPlaneProcess,
                                                                         tmp_path: Path) -> None:
    ident = cp.issue("reader", {"site.read": "direct"})
    registered = tether(cp, "grant", "register", "--chain", str(ident.chain_path), "--key", str(ident.key_path),
                        cwd=tmp_path)
    assert registered.returncode == 0, registered.stderr
    before = tether(cp, "audit", "surface", "--json", cwd=tmp_path)
    assert before.returncode == 0, before.stderr
    (tmp_path / "old.json").write_text(before.stdout)
    old = json.loads(before.stdout)
    assert old["version"] == 2
    assert old["agents"]["reader"]["site.read"]["wire"]["http"]["path"] == "/public/*"
    human = tether(cp, "audit", "surface", "--agent", "reader", cwd=tmp_path).stdout
    assert "site.read" in human and "GET api.example.com/public/*" in human

    cp.stop()
    cp.catalog_path.write_text(cp.catalog_path.read_text().replace("'/public/*'", "'/*'"))
    cp.start()
    after = tether(cp, "audit", "surface", "--json", cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    (tmp_path / "new.json").write_text(after.stdout)
    assert json.loads(after.stdout)["catalog"] != old["catalog"]

    gate = tether(cp, "audit", "diff", "old.json", "new.json", cwd=tmp_path)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert 'WIDENED reader: site.read path widened: "/public/*" -> "/*"' in gate.stdout
    same = tether(cp, "audit", "diff", "new.json", "new.json", cwd=tmp_path)
    assert same.returncode == 0 and "no capability widened" in same.stdout


# -- a hostile diff does not stall the control plane ------------------------------------------------------------
def hostile_surface(path: str, agents: int) -> dict:
    wire = {"http": {"host": "h.example", "port": None, "methods": ["GET"], "path": path}}
    return {"version": 2, "catalog": "sha256:x",
            "agents": {f"a{i}": {"web": {"tier": "direct", "wire": wire, "budget": None}} for i in range(agents)}}


def test_healthz_answers_while_a_hostile_diff_is_computed(cp: ControlPlaneProcess) -> None:
    """Twelve reviewer pairs: seconds of search (the diff's budget), off the event loop, so the control plane
    keeps answering; on the loop, /healthz would wait for the diff (the sidecars' lease is 15 s)."""
    new, old = hostile(110)
    body = json.dumps({"old": hostile_surface(old, 12), "new": hostile_surface(new, 12)}).encode()
    done = threading.Event()
    result: dict = {}

    def post() -> None:
        req = urllib.request.Request(cp.url + "/v1/audit/diff", data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                result["doc"] = json.loads(resp.read())
        finally:
            done.set()

    worker = threading.Thread(target=post)
    worker.start()
    answered_during = 0
    try:
        done.wait(0.5)  # let the diff start computing (if it is already done, the loop below proves nothing)
        while not done.is_set():
            assert cp.client().request("GET", "/healthz")["status"] == "ok"
            answered_during += not done.is_set()
    finally:
        worker.join(120)
    assert len(result["doc"]["widened"]) == 12 and result["doc"]["exit"] == 1
    assert sum("not a shortest one" in line for line in result["doc"]["widened"]) > 0  # the budget was reached
    assert answered_during >= 3, "the control plane answered /healthz too rarely while the diff ran"
