"""The sidecar's per-call decision, ``decision.decide``, timed alone, against the code before a change.

Run: python bench/bench_decide.py [--before DIR]

With ``--before DIR`` (a checkout of earlier code, e.g. ``git archive COMMIT | tar -x -C DIR``), the same
workload runs from both trees, each in its own interpreter (one package cannot be imported twice in one), in
alternating rounds (A B A B ...), and the ratio after/before of each figure is printed. Without it, only this
tree is timed.

The workload is one pass over a mix of calls, each decided once per pass as the sidecar decides it: an allowed
GET, a held PUT, a call no capability covers, one to an unknown host, an MCP ``tools/call`` (body read), a batch
of two, the MCP GET stream and a JSON-RPC POST before its body. The catalog and a real chain state
(``SidecarState`` over a minted chain) are built once per interpreter; the catalog's memo answers repeated
request lines as it does in a sidecar. A figure is the mean ns of one decide() in a batch, in this thread's CPU
time; each round prints the fastest of its batches; over the rounds the minimum and the p50 are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROUNDS = 12
BATCHES = 30  # per round
PASSES = 200  # per batch

WORKER = r'''
import json, sys, time
from dataclasses import replace
from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import Verifier, mint_root
from tether.proxy.decision import Facts, decide
from tether.proxy.state import SidecarState

CATALOG = parse_catalog("""
capabilities:
  files.read:  {http: {host: files.example, methods: [GET], path: "/files/*"}}
  files.write: {http: {host: files.example, methods: [PUT, POST], path: "/files/*"}}
  files.list:  {http: {host: list.example, port: 8443, methods: [GET], path: "/list"}}
  mail.send:   {mcp: {url: "http://mcp.example/mcp", tool: send}}
  mail.read:   {mcp: {url: "http://mcp.example/mcp", tool: read}}
  docs.read:   {mcp: {url: "http://mcp.example/mcp", resource: "docs://*"}}
""" + "".join(f"  svc{i}.read: {{http: {{host: api{i}.example, methods: [GET], path: '/v1/*'}}}}\n"
              for i in range(40)))
T0, MONO = 1_750_000_000.0, 1000.0
trust, agent = keys.generate(), keys.generate()
wire = mint_root(trust, agent="a", subject_key=agent.public_key(), now=T0, ttl_s=3600, depth=0, catalog=CATALOG,
                 caps={"files.read": "direct", "files.write": "approval", "mail.send": "direct",
                       "mail.read": "approval", "docs.read": "direct"})
verifier = Verifier(trust.public_key(), catalog_hash=CATALOG.hash, leeway=30)
state = SidecarState(verifier.verify(wire, now=T0), verifier, lease_ttl_s=15.0)
state.renewed(MONO)

def facts(method, path, host="files.example", port=80, **more):
    return Facts(method=method, sent_method=method, host=host, port=port, path=path,
                 url=f"http://{host}:{port}{path.split('?', 1)[0]}", now=T0 + 10, now_mono=MONO + 1, **more)

def body(*messages):
    doc = [{"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": t, "arguments": {}}}
           for i, t in enumerate(messages)]
    return json.dumps(doc if len(doc) > 1 else doc[0]).encode()

CALLS = [facts("GET", "/files/a"), facts("PUT", "/files/a"), facts("DELETE", "/files/a"),
         facts("GET", "/x", host="nowhere.example"), facts("POST", "/mcp", host="mcp.example", body=body("send")),
         facts("POST", "/mcp", host="mcp.example", body=body("send", "read")),
         facts("GET", "/mcp", host="mcp.example"), facts("POST", "/mcp", host="mcp.example"),
         facts("GET", "/v1/items/7", host="api17.example")]
batches, passes = int(sys.argv[1]), int(sys.argv[2])
best = None
for _ in range(batches):
    t0 = time.thread_time_ns()
    for _ in range(passes):
        for f in CALLS:
            decide(CATALOG, state, f)
    ns = (time.thread_time_ns() - t0) / (passes * len(CALLS))
    best = ns if best is None else min(best, ns)
print(json.dumps({"ns": best}))
'''


def run_round(tree: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", WORKER, str(BATCHES), str(PASSES)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ns"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="DIR", help="also time the checkout in DIR, rounds alternating")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = {"after": here} | ({"before": Path(args.before).resolve()} if args.before else {})
    load_start = os.getloadavg()[0]
    figures: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name in (["before", "after"] if args.before else ["after"]):
            figures[name].append(run_round(trees[name]))
    load_end = os.getloadavg()[0]
    print(f"decide(): {len(trees)} tree(s), {args.rounds} rounds x {BATCHES} batches x {PASSES} passes of 9 calls; "
          f"load average {load_start:.2f} -> {load_end:.2f} on {os.cpu_count()} CPUs")
    for name, values in figures.items():
        print(f"  {name:6}  min {min(values):7.0f} ns/call   p50 {statistics.median(values):7.0f} ns/call")
    if args.before:
        lo = min(figures["after"]) / min(figures["before"])
        mid = statistics.median(figures["after"]) / statistics.median(figures["before"])
        print(f"  after/before: min {lo:.3f}x   p50 {mid:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
