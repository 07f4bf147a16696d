"""``tether demo``: the whole story on an embedded store, in one process tree, narrated.

A control plane (SQLite), a ticket API and an MCP server start on loopback. A root agent runs under
``tether run`` and delegates to two children and a grandchild, each a real agent script under its own
sidecar. Calls flow (one refused as absent, one held and approved), one branch is revoked by its
parent, then the root is terminated with a drain while calls are in flight, and the signed record is
read back and verified. Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.controlplane.client import Client, Signer
from tether.controlplane.termination import verify_records

from ..text import colour

CATALOG = """\
# The demo's capability catalog: what each capability means on the wire.
capabilities:
  tickets.read:   {{http: {{host: 127.0.0.1, port: {http}, methods: [GET], path: "/tickets*"}}}}
  tickets.write:  {{http: {{host: 127.0.0.1, port: {http}, methods: [POST], path: "/tickets"}}}}
  tickets.delete: {{http: {{host: 127.0.0.1, port: {http}, methods: [DELETE], path: "/tickets/*"}}}}
  research.read:  {{http: {{host: 127.0.0.1, port: {http}, methods: [GET], path: "/research"}}}}
  kb.lookup:      {{mcp: {{url: "http://127.0.0.1:{mcp}/mcp", tool: lookup}}}}
  mail.send:      {{mcp: {{url: "http://127.0.0.1:{mcp}/mcp", tool: send_email}}}}
  db.drop:        {{mcp: {{url: "http://127.0.0.1:{mcp}/mcp", tool: drop_database}}}}
roles:
  lead: {{tickets.read: direct, tickets.write: approval, research.read: direct, kb.lookup: direct, mail.send: approval}}
"""

BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if colour(sys.stdout) else ("", "", "")  # never under NO_COLOR


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoFailed(Exception):
    pass


class Demo:
    def __init__(self, directory: Path, fast: bool, console: bool = False) -> None:
        self.dir = directory
        self.fast = fast
        self.console = console
        self.procs: list[subprocess.Popen] = []
        self.token = secrets.token_urlsafe(16)
        self.ports = {"cp": free_port(), "http": free_port(), "mcp": free_port()}
        self.cp_url = f"http://127.0.0.1:{self.ports['cp']}"
        self.client = Client(self.cp_url, self.token)
        self.step_no = 0
        self.env = {**os.environ, "TETHER_ADMIN_TOKEN": self.token, "TETHER_CONTROLPLANE": self.cp_url,
                    "DEMO_TICKETS": f"http://127.0.0.1:{self.ports['http']}",
                    "DEMO_MCP": f"http://127.0.0.1:{self.ports['mcp']}/mcp", "TETHER_LOG": "WARNING",
                    "PYTHONUNBUFFERED": "1", "TETHER_CAPTURES": str(directory / "agents")}

    # -- narration ---------------------------------------------------------------------------------
    def step(self, title: str, text: str) -> None:
        self.step_no += 1
        print(f"\n{BOLD}{self.step_no}. {title}{RESET}" + (f"\n   {text}" if text else ""), flush=True)

    def note(self, text: str) -> None:
        print(f"   {text}", flush=True)

    def pause(self, seconds: float) -> None:
        time.sleep(seconds / 3 if self.fast else seconds)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise DemoFailed(f"timed out waiting for {what}")

    # -- processes -----------------------------------------------------------------------------------
    def start(self, name: str, args: list[str], **kwargs: Any) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=kwargs.pop("stdout", log), stderr=log, env=self.env,
                                cwd=self.dir, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        pids = [p.pid for p in self.procs if p.poll() is None]
        for ready in (self.dir / "agents").glob("*/sidecar.ready"):
            with contextlib.suppress(ValueError, OSError):
                pids.append(int(json.loads(ready.read_text())["pid"]))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for pid in pids:
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2)

    def relay(self, proc: subprocess.Popen) -> threading.Thread:
        def run() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"   {DIM}│ {line.rstrip()}{RESET}", flush=True)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    # -- the story -----------------------------------------------------------------------------------
    def run(self) -> int:
        self._start_services()
        root_key = self._issue_root_grant()
        root = self._run_root()
        relay = self.relay(root)
        self._approve_held_call()
        self._show_tree()
        self._revoke_writer(root_key)
        record = self._terminate_root()
        root.wait(timeout=30)
        relay.join(timeout=5)
        return self._show_record(record)

    def _start_services(self) -> None:
        py = sys.executable
        self.step("Start a control plane and two tool servers",
                  "The control plane keeps grants, revocations, reports and records in one SQLite file.")
        (self.dir / "catalog.yaml").write_text(CATALOG.format(http=self.ports["http"], mcp=self.ports["mcp"]))
        self.start("tools", [py, "-m", "tether", "example", "tools", "--http", f"127.0.0.1:{self.ports['http']}",
                             "--mcp", f"127.0.0.1:{self.ports['mcp']}"])
        self.start("controlplane", [py, "-m", "tether", "controlplane", "serve", "--listen",
                                    f"127.0.0.1:{self.ports['cp']}", "--store", "sqlite:///tether.db",
                                    "--catalog", "catalog.yaml", "--signing-key", "signing.key",
                                    "--lease-ttl", "5", "--grace", "2"])
        self.wait("the control plane", self._healthy)
        self.wait("the tool servers", lambda: _port_open(self.ports["http"]) and _port_open(self.ports["mcp"]))
        self.note(f"control plane {self.cp_url}   ticket API :{self.ports['http']}   MCP server "
                  f":{self.ports['mcp']}   files in {self.dir}")
        self.note(f"console {self.cp_url}/ui/   admin token {self.token}")
        self.people = self._add_operators()

    def _add_operators(self) -> dict[str, Client]:
        """The people who decide: alice approves held calls, rita terminates; what they do carries their name."""
        people = {}
        for name, role in (("alice", "approver"), ("rita", "responder")):
            try:
                added = self.client.request("POST", "/v1/operators", {"name": name, "roles": [role]})
            except ApiError as exc:  # a second demo run in one directory: the operator is there, give a new token
                if exc.http_status != 409:
                    raise
                added = self.client.request("POST", f"/v1/operators/{name}/rotate", {})
            people[name] = Client(self.cp_url, added["token"])
            self.note(f"$ tether operators add {name} --role {role}   (token {added['token']})")
        return people

    def _issue_root_grant(self) -> Ed25519PrivateKey:
        self.step("Issue the root agent's grant",
                  "Role 'lead' from the catalog: read tickets and research directly, write tickets only with "
                  "a person's approval, look things up over MCP. Deleting tickets and dropping databases are "
                  "absent: for this agent they do not exist.")
        root_key = keys.generate()
        (self.dir / "root.key").write_bytes(keys.private_pem(root_key))
        os.chmod(self.dir / "root.key", 0o600)
        grant = self.client.request("POST", "/v1/grants", {
            "agent": "root", "subject_key": keys.to_jwk(root_key.public_key()), "role": "lead", "ttl_s": 3600,
            "depth": 3})
        (self.dir / "root.chain").write_text(",".join(grant["chain"]) + "\n")
        self.note(f"root grant jti {grant['jti']} written to {self.dir / 'root.chain'}")
        return root_key

    def _run_root(self) -> subprocess.Popen:
        py = sys.executable
        self.step("Run the root agent under tether",
                  "`tether run` starts a sidecar and runs the unmodified agent script enforced: its only way out "
                  "is the sidecar, whatever client it uses, and it holds no key. The agent spawns its own "
                  "sub-agents, each under `tether run` with a narrower grant, which its enclosing tether run "
                  "delegates for it.")
        return self.start("root", [py, "-m", "tether", "run", "--chain", "root.chain", "--key",
                                   "root.key", "--state-dir", "agents", "--", py, "-m",
                                   "tether.cli.demo.agent", "root"], stdout=subprocess.PIPE, text=True)

    def _approve_held_call(self) -> None:
        approval = self.wait("the approval request", lambda: self.client.request(
            "GET", "/v1/approvals?status=pending"), timeout=90)[0]
        self.pause(1.0)
        self.step("A call waits for a person",
                  f"{approval['agent']} wants {approval['method']} {approval['url']} "
                  f"({approval['capability']} is granted with tier 'approval'). The call is held at the "
                  "sidecar; nothing has left. A person approves it:")
        if self.console:  # the person decides in the browser, seeing the exact call
            self.note(f"Approve or deny it in the console: {self.cp_url}/ui/ (sign in as alice with her token "
                      "above, or with the admin token), within 2 minutes")
            self.wait("a decision in the console", lambda: self.client.request(
                "GET", f"/v1/approvals/{approval['id']}")["status"] != "pending", timeout=120)
        else:
            self.note(f"$ tether approvals approve {approval['id']}      (as alice: TETHER_TOKEN=her token)")
            self.people["alice"].request("POST", f"/v1/approvals/{approval['id']}/approve", {})

    def _show_tree(self) -> None:
        tree = self.wait("all four agents behind live sidecars", self._four_live, timeout=90)
        self.pause(1.5)
        self.step("The delegation tree", "Every link is registered before use, so the control plane knows "
                  "every descendant ($ tether agents --tree):")
        from tether.cli.agents import print_tree

        for node in tree:
            print_tree(node, "   ", True, top=True)

    def _revoke_writer(self, root_key: Ed25519PrivateKey) -> None:
        # The live link (a demo run again into the same directory re-grants every id: the old links stay, revoked).
        writer = next(a for a in self.client.request("GET", "/v1/agents")["agents"]
                      if a["agent"] == "writer" and a["status"] == "active")
        self.step("Revoke one branch, as its parent",
                  "root signs a revocation of writer's link with its own key (an ancestor may revoke a "
                  "descendant; an agent can never revoke itself). Every chain containing the link dies at once.")
        if self.console:  # the person revokes in the browser
            self.note(f"Revoke writer in the console (Agents, 'Revoke writer'): {self.cp_url}/ui/, within 3 minutes")
            self.wait("writer's link revoked in the console", lambda: any(
                a["link"] == writer["link"] and a["status"] == "revoked"
                for a in self.client.request("GET", "/v1/agents")["agents"]), timeout=180)
        else:
            root_chain = (self.dir / "root.chain").read_text().strip()
            signer = Signer("root", parse_chain_unverified(root_chain)[-1].hash, root_key)
            self.note(f"$ tether revoke {writer['jti']} --chain root.chain --key root.key")
            self.client.request("POST", f"/v1/grants/{writer['jti']}/revoke", {"reason": "demo: branch revoked"},
                                signer=signer)
        self.wait("writer to be refused", lambda: any(
            r.get("code") == "tether.chain_revoked" and r.get("link") == writer["link"]
            for r in self.client.request("GET", "/v1/reports?agent=writer")))
        self.pause(1.0)

    def _terminate_root(self) -> dict:
        self.step("Terminate the root with a drain, calls in flight",
                  "The control plane revokes the whole subtree, tells each sidecar to drain (new calls refused, "
                  "in-flight calls get 4 s to finish, then are cut), collects their final reports and "
                  "acknowledgements, and writes a signed record.")
        if self.console:  # the person terminates in the browser
            earlier = {t["id"] for t in self.client.request("GET", "/v1/terminations")}
            self.note(f"Terminate root in the console (Agents, 'Terminate root': drain, window 4): {self.cp_url}/ui/, "
                      "within 3 minutes")
            term = self.wait("a termination of root from the console", lambda: next(
                (t for t in self.client.request("GET", "/v1/terminations")
                 if t["subject"] == "root" and t["id"] not in earlier), None), timeout=180)
            term = {**term, "termination_id": term["id"]}
        else:
            self.note("$ tether terminate root --mode drain --window 4      (as rita, a responder)")
            term = self.people["rita"].request("POST", "/v1/agents/root/terminate",
                                       {"mode": "drain", "window_s": 4, "reason": "demo: stop the fleet"})
        seen = {"requested"}
        doc = term
        deadline = time.monotonic() + 40 + (doc.get("window_s") or 0)
        while doc["state"] != "terminated":
            if time.monotonic() > deadline:
                raise DemoFailed("the termination did not finish")
            time.sleep(0.2)
            doc = self.client.request("GET", f"/v1/terminations/{term['termination_id']}")
            if doc["state"] not in seen:
                seen.add(doc["state"])
                self.note(f"termination {doc['id']}: {doc['state']}")
        record = self.client.request("GET", f"/v1/records/{term['termination_id']}")
        (self.dir / "record.json").write_text(json.dumps(record, indent=2))
        return record

    def _show_record(self, record: dict) -> int:
        self.step("The reconciliation record", "What became of every call, from outside the workload "
                  "($ tether records show ID):")
        from tether.cli.ops import print_record_summary

        print_record_summary(record)
        records = self.client.request("GET", "/v1/records")
        trust = keys.from_jwk(self.client.request("GET", "/v1/trust", admin=False)["jwk"])
        result = verify_records(records, trust)
        self.note(f"$ tether records verify  ->  {'ok' if result.ok else 'FAILED'}: {result.count} record(s), "
                  "hash chain and signatures checked")
        har = self._export_har(record)
        self.step("Where everything is", "")
        self.note(f"record        {self.dir / 'record.json'}")
        self.note(f"captures      {self.dir / 'agents'}/<agent>/captures/flows.mitm (secrets redacted)")
        self.note(f"HAR export    {har}  (open in a browser's devtools)")
        self.note(f"logs          {self.dir}/*.log, {self.dir}/agents/<agent>/sidecar.log")
        if not result.ok or record["agents_unaccounted"]:
            raise DemoFailed("the record does not account for every agent")
        return 0

    def _healthy(self) -> bool:
        try:
            return self.client.request("GET", "/healthz")["status"] == "ok"
        except Exception:
            return False

    def _four_live(self) -> list | None:
        data = self.client.request("GET", "/v1/agents")
        live = {a["agent"] for a in data["agents"] if a["sidecar"] and a["sidecar"]["lease"] == "live"}
        return data["tree"] if {"root", "researcher", "writer", "summarizer"} <= live else None

    def _export_har(self, record: dict) -> Path:
        """The HAR ``tether capture export --termination`` writes: each entry lined up with the record's call."""
        out = self.dir / "captures.har"
        self.note(f"$ tether capture export --termination {record['termination_id']} --captures agents "
                  "--har captures.har")
        done = subprocess.run([sys.executable, "-m", "tether", "capture", "export", "--termination",
                               record["termination_id"], "--captures", "agents", "--har", out.name],
                              cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise DemoFailed(f"tether capture export failed: {(done.stderr or done.stdout).strip()}")
        self.note(done.stdout.strip())
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def cmd_demo(args: argparse.Namespace) -> int:
    # Ctrl-C stops the demo and everything it started, even when whoever started it had Ctrl-C ignored (an
    # ignored SIGINT is inherited across exec; a handler is not).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tether-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"{BOLD}tether demo{RESET}: a fleet of agents made stoppable. Everything runs on 127.0.0.1 and stops "
          "at the end.")
    demo = Demo(directory.resolve(), args.fast, args.console)
    started = time.monotonic()
    try:
        code = demo.run()
        if code == 0 and args.console:
            print(f"\nThe console stays up at {demo.cp_url}/ui/ (admin token {demo.token}): the tree, the "
                  "approvals, the termination and its record, the HAR. Ctrl-C stops everything.", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    except DemoFailed as exc:
        print(f"\ndemo failed: {exc} (logs in {directory})", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        demo.stop_all()
    if code == 0:
        print(f"\n{BOLD}done{RESET} in {time.monotonic() - started:.0f}s; nothing is left running.")
    return code
