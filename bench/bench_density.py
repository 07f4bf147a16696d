"""A node's memory per idle agent: RSS, PSS and USS from /proc/PID/smaps_rollup, summed over each agent's processes
(the command excluded), at 1, 10, 30 and 100 agents, against bare mitmdump in the same run.

Run: python bench/bench_density.py [--agents 1,10,30,100] [--setups mitmdump,sidecar,run,node] [--cooperative]
     [--before DIR]   (~5-15 minutes at 100 agents on two busy cores)

Setups, each started N times against one control plane and measured once all N serve (3 s later):

- ``mitmdump``: bare mitmdump, no addons (the baseline);
- ``sidecar``: ``tether sidecar`` alone, no command;
- ``run``: ``tether run -- sleep`` (enforced unless ``--cooperative``): the sidecar serving in run's own process,
  which supervises the command; the enclosure's two small processes counted with it;
- ``node``: ``tether run --node SOCKET -- sleep`` against one ``tether node serve``: each agent a fork of the
  pre-loaded server plus the ``/bin/sh`` shim its caller became; the server's own PSS shared out over the agents;
- ``before`` and ``node-before`` (with ``--before DIR``, a checkout of older code, e.g. ``git archive COMMIT | tar
  -x -C DIR``): its ``tether run``, and its node server with its ``tether run --node``, in the same run.

PSS charges each shared page to the processes mapping it in equal parts, so the sum over a node is what the node
pays; USS is what an agent alone holds. Targets (issue 28): at 30 agents under 25 MiB PSS per agent including
any wrapper; 100 idle agents under 2.5 GiB PSS.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_sidecar as bs  # noqa: E402

from tests.harness import PYTHON, free_port, prepare_controlplane, wait_until  # noqa: E402

PSS_TARGET_30 = 25.0
PSS_TARGET_100_GIB = 2.5
STARTING_AT_ONCE = 4  # agents starting together: the start-up is CPU-bound


def rollup(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of one process, MiB."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (children of every thread: run starts its command from a worker thread)."""
    try:
        children = " ".join(Path(t, "children").read_text() for t in Path(f"/proc/{pid}/task").iterdir()).split()
    except OSError:
        return []
    return [pid, *(p for c in children for p in tree(int(c)))]


def is_command(pid: int) -> bool:
    """The agent's own command (``sleep``), which no setup counts."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "sleep"
    except OSError:
        return True


@dataclass
class Agent:
    proc: subprocess.Popen
    ready: Path
    pids: list[int] = field(default_factory=list)  # beside proc's own tree: the node's fork


def measure(agents: list[Agent], shared: list[int]) -> dict[str, float]:
    """Per agent (mean) RSS, PSS, USS over its processes, with ``shared`` (the node server) divided among them."""
    total = {"rss": 0.0, "pss": 0.0, "uss": 0.0}
    for agent in agents:
        for pid in {*tree(agent.proc.pid), *(p for q in agent.pids for p in tree(q))}:
            if not is_command(pid):
                for k, v in rollup(pid).items():
                    total[k] += v
    for pid in shared:
        for k, v in rollup(pid).items():
            total[k] += v
    return {k: v / len(agents) for k, v in total.items()} | {"pss_total": total["pss"]}


def start_all(n: int, start: object) -> list[Agent]:
    with concurrent.futures.ThreadPoolExecutor(STARTING_AT_ONCE) as pool:
        return list(pool.map(start, range(n)))  # type: ignore[arg-type]


def wait_ready(agent: Agent, log: Path) -> None:
    def up() -> bool:
        if agent.proc.poll() is not None:
            raise AssertionError(f"exited {agent.proc.returncode}: {log.read_text()[-1500:]}")
        return agent.ready.exists()

    wait_until(up, 300, interval=0.2, what=f"{agent.ready}")


def stop_all(agents: list[Agent]) -> None:
    for agent in agents:
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
    for agent in agents:
        try:
            agent.proc.wait(60)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="1,10,30,100")
    parser.add_argument("--setups", default="mitmdump,sidecar,run,node",
                        help="with --before, before and node-before may be named too (else both run)")
    parser.add_argument("--cooperative", action="store_true", help="tether run --cooperative (no enclosure)")
    parser.add_argument("--before", metavar="DIR", help="also the tether run and the node server of the checkout in "
                        "DIR (setups before, node-before)")
    args = parser.parse_args()
    counts = [int(c) for c in args.agents.split(",")]
    setups = args.setups.split(",")
    if args.before and not {"before", "node-before"} & set(setups):  # named in --setups: only those
        setups += ["before", "node-before"]
    work = Path(tempfile.mkdtemp(prefix="tether-bench-density-"))
    print(f"tether density  {time.strftime('%Y-%m-%d %H:%M')}  python {platform.python_version()}  load average "
          f"{os.getloadavg()[0]:.2f}  {'cooperative' if args.cooperative else 'enforced'}", flush=True)
    cp = prepare_controlplane(work / "cp", free_port(), free_port(), free_port(), lease_ttl=30.0, grace=5.0)
    cp.start()
    env = {k: v for k, v in cp.env().items() if k != "TETHER_ADMIN_TOKEN"}
    mode = ["--cooperative"] if args.cooperative else []
    rows: list[tuple[str, int, dict[str, float]]] = []
    serial = iter(range(1_000_000))
    try:
        for n in counts:
            for setup in setups:
                batch = next(serial)
                root = work / f"{setup}-{n}-{batch}"
                root.mkdir()
                server: subprocess.Popen | None = None
                before = args.before if setup in ("before", "node-before") else None  # python -m runs DIR's code
                if setup in ("node", "node-before"):
                    sock = root / "node.sock"
                    server = subprocess.Popen([PYTHON, "-m", "tether", "node", "serve", "--socket", str(sock)],
                                              env=env, stdout=subprocess.DEVNULL, stderr=open(root / "node.log", "w"),
                                              cwd=before)
                    wait_until(sock.exists, 60, what="the node server")

                def start(i: int, setup: str = setup, root: Path = root, batch: int = batch,
                          before: str | None = before) -> Agent:
                    log = root / f"{i}.log"
                    out = open(log, "w")
                    if setup == "mitmdump":
                        m = bs.MitmdumpProcess(root / f"m{i}", root / "none.pem")
                        m.directory.mkdir(parents=True)
                        proc = subprocess.Popen(m.command(), stdout=out, stderr=out)
                        agent = Agent(proc, m.ca)
                        wait_ready(agent, log)
                        return agent
                    ident = cp.issue(f"d{batch}-{i}", {"issues.read": "direct"})
                    ready = root / f"{i}.ready"
                    if setup == "sidecar":
                        argv = [PYTHON, "-m", "tether", "sidecar", "--chain", str(ident.chain_path), "--key",
                                str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir", str(root / f"s{i}"),
                                "--ready-file", str(ready)]
                    else:
                        node = ["--node", str(root / "node.sock")] if setup in ("node", "node-before") else []
                        argv = [PYTHON, "-m", "tether", "run", *node, *mode, "--chain", str(ident.chain_path),
                                "--key", str(ident.key_path), "--state-dir", str(root / "state"), "--ready-file",
                                str(ready), "--", "sleep", "3600"]
                    proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=before)
                    agent = Agent(proc, ready)
                    wait_ready(agent, log)
                    return agent

                if setup == "mitmdump":
                    (root / "none.pem").write_text("")
                t0 = time.monotonic()
                agents = start_all(n, start)
                started = time.monotonic() - t0
                try:
                    time.sleep(3.0)
                    shared: list[int] = []
                    if server is not None:
                        for agent in agents:  # the fork serving it, under the server
                            agent.pids.append(json.loads(agent.ready.read_text())["pid"])
                        shared = [server.pid]
                    figures = measure(agents, shared)
                    figures["start_s"] = started
                    rows.append((setup, n, figures))
                    print(f"  {setup:9s} x{n:<4d} RSS {figures['rss']:6.1f}  PSS {figures['pss']:6.1f}  USS "
                          f"{figures['uss']:6.1f} MiB/agent  (node PSS {figures['pss_total'] / 1024:.2f} GiB; "
                          f"started in {started:.0f}s)", flush=True)
                finally:
                    stop_all(agents)
                    if server is not None:
                        server.terminate()
                        server.wait(30)
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print("| setup | agents | RSS MiB/agent | PSS MiB/agent | USS MiB/agent | PSS of all agents GiB | "
          "PSS vs mitmdump |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    bare = {n: f["pss"] for s, n, f in rows if s == "mitmdump"}
    for setup, n, f in rows:
        ratio = f"{f['pss'] / bare[n]:.2f}x" if n in bare else "-"
        print(f"| {setup} | {n} | {f['rss']:.1f} | {f['pss']:.1f} | {f['uss']:.1f} | {f['pss_total'] / 1024:.2f} | "
              f"{ratio} |")
    print()
    for setup in ("run", "node", "node-before"):
        at30 = [f for s, n, f in rows if s == setup and n == 30]
        at100 = [f for s, n, f in rows if s == setup and n == 100]
        if at30:
            pss = at30[0]["pss"]
            print(f"verdict {setup}: at 30 agents {pss:.1f} MiB PSS per agent, target < {PSS_TARGET_30:.0f}: "
                  f"{'met' if pss < PSS_TARGET_30 else 'MISSED'}")
        if at100:
            gib = at100[0]["pss_total"] / 1024
            print(f"verdict {setup}: 100 agents {gib:.2f} GiB PSS, target < {PSS_TARGET_100_GIB}: "
                  f"{'met' if gib < PSS_TARGET_100_GIB else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
