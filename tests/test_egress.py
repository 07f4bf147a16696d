"""The egress lock: the generated rules, and the rules enforced by a real kernel in network namespaces.

The namespace test builds a tiny world: an "agent pod" namespace and an "internet" namespace joined by
a veth pair. A listener in the internet answers ``internet``; one on the pod's 127.0.0.1 stands for the
sidecar. Clients run as the agent's uid and as the sidecar's uid (setpriv) and say who answered.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tether.proxy.egress import CHAIN, NAT_CHAIN, EgressError, EgressLock, main, restore_script, rule_args, tables

SIDECAR_UID = 10001
AGENT_UID = 12345
PROXY_PORT = 8080
TPORT = 15001
TOOL_PORT = 9000
DNS_PORT = 15053


# -- the rules as data ---------------------------------------------------------------------------------------
def test_explicit_mode_accepts_loopback_established_and_sidecar_then_rejects() -> None:
    rules = tables(EgressLock(SIDECAR_UID, PROXY_PORT))
    assert set(rules) == {"filter"}, "explicit mode must not touch nat"
    chain = [r for r in rules["filter"] if r[1] == CHAIN]
    assert ["-A", "OUTPUT", "-j", CHAIN] in rules["filter"]
    assert chain[0] == ["-A", CHAIN, "-o", "lo", "-j", "ACCEPT"]
    assert chain[1][-3:] == ["ESTABLISHED,RELATED", "-j", "ACCEPT"]
    assert chain[2] == ["-A", CHAIN, "-m", "owner", "--uid-owner", "10001", "-j", "ACCEPT"]
    assert chain[-2] == ["-A", CHAIN, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]
    assert chain[-1] == ["-A", CHAIN, "-j", "REJECT", "--reject-with", "icmp-port-unreachable"]
    # nothing else is accepted for other uids: no DNS, no port-53 hole
    assert not any("53" in r for r in chain)


def test_transparent_mode_redirects_other_uids_tcp_but_not_the_sidecars() -> None:
    nat = tables(EgressLock(SIDECAR_UID, PROXY_PORT, TPORT))["nat"]
    assert nat[0] == ["-A", "OUTPUT", "-p", "tcp", "-j", NAT_CHAIN]
    returns = nat[1:-1]
    assert returns == [["-A", NAT_CHAIN, "-m", "owner", "--uid-owner", "10001", "-j", "RETURN"]]  # loopback too
    assert nat[-1] == ["-A", NAT_CHAIN, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(TPORT)]
    # the redirected packet still carries its first route's interface, so the filter must let it in by address
    filt = [" ".join(r) for r in tables(EgressLock(SIDECAR_UID, PROXY_PORT, TPORT))["filter"]]
    assert f"-A {CHAIN} -d 127.0.0.1 -p tcp --dport {TPORT} -m conntrack --ctstate DNAT -j ACCEPT" in filt


def test_dns_port_sends_other_uids_dns_to_the_sidecars_resolver_on_ipv4_only() -> None:
    lock = EgressLock(SIDECAR_UID, PROXY_PORT, TPORT, dns_port=15053)
    nat = [" ".join(r) for r in tables(lock, 4)["nat"]]
    assert "-A OUTPUT -p udp --dport 53 -j TETHER_REDIRECT" in nat
    assert nat.index("-A TETHER_REDIRECT -m owner --uid-owner 10001 -j RETURN") < nat.index(
        "-A TETHER_REDIRECT -p udp --dport 53 -j REDIRECT --to-ports 15053")  # the sidecar's own DNS goes out
    filt = [" ".join(r) for r in tables(lock, 4)["filter"]]
    assert f"-A {CHAIN} -d 127.0.0.1 -p udp --dport 15053 -m conntrack --ctstate DNAT -j ACCEPT" in filt
    assert not any("udp" in r for r in [" ".join(r) for r in tables(lock, 6)["nat"]])  # v6 DNS: rejected
    with pytest.raises(EgressError, match="transparent"):
        EgressLock(SIDECAR_UID, PROXY_PORT, dns_port=15053)


def test_agent_dns_opens_only_the_named_resolvers_per_family() -> None:
    lock = EgressLock(SIDECAR_UID, agent_dns=("10.96.0.10", "fd00::a"))
    v4 = [" ".join(r) for r in tables(lock, 4)["filter"]]
    v6 = [" ".join(r) for r in tables(lock, 6)["filter"]]
    assert any("-d 10.96.0.10 -p udp --dport 53 -j ACCEPT" in r for r in v4)
    assert not any("fd00::a" in r for r in v4)
    assert any("-d fd00::a -p udp --dport 53 -j ACCEPT" in r for r in v6)
    assert not any("10.96.0.10" in r for r in v6)


def test_ipv6_keeps_neighbour_discovery_and_uses_icmp6_rejects() -> None:
    filt = tables(EgressLock(SIDECAR_UID), 6)["filter"]
    assert ["-A", CHAIN, "-p", "ipv6-icmp", "--icmpv6-type", "neighbour-solicitation", "-j", "ACCEPT"] in filt
    assert filt[-1][-1] == "icmp6-port-unreachable"


def test_rule_args_create_chains_before_using_them() -> None:
    args = rule_args(EgressLock(SIDECAR_UID, transparent_port=TPORT))
    assert args[0] == ["-t", "filter", "-N", CHAIN]
    nat_new = args.index(["-t", "nat", "-N", NAT_CHAIN])
    assert all(a[1] == "filter" for a in args[:nat_new])
    assert all(a[1] == "nat" for a in args[nat_new:])


def test_restore_script_has_one_commit_per_table() -> None:
    script = restore_script(EgressLock(SIDECAR_UID, transparent_port=TPORT))
    assert script.count("COMMIT") == 2
    assert "*filter" in script and "*nat" in script
    assert f":{CHAIN} - [0:0]" in script


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"sidecar_uid": 0}, "non-root"),
        ({"sidecar_uid": 10001, "proxy_port": 0}, "out of range"),
        ({"sidecar_uid": 10001, "proxy_port": 8080, "transparent_port": 8080}, "differ"),
        ({"sidecar_uid": 10001, "agent_dns": ("kube-dns",)}, "IP address"),
    ],
)
def test_bad_locks_are_refused_with_a_reason(kwargs: dict, fragment: str) -> None:
    with pytest.raises(EgressError, match=fragment) as info:
        EgressLock(**kwargs)
    assert info.value.code == "tether.egress_failed"


def test_main_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sidecar-uid", "10001", "--proxy-port", "8080", "--ipv6", "off", "--print"]) == 0
    assert capsys.readouterr().out == restore_script(EgressLock(10001, 8080))


def test_main_refuses_root(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sidecar-uid", "0", "--print"]) == 2
    assert "tether.egress_failed" in capsys.readouterr().err


# -- the rules in a real kernel ------------------------------------------------------------------------------
SERVER = r"""
import socket, struct, sys
host, port, banner = sys.argv[1], int(sys.argv[2]), sys.argv[3]
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind((host, port))
tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind((host, port))
tcp.listen(16)
print("ready", flush=True)
import selectors
sel = selectors.DefaultSelector()
sel.register(tcp, selectors.EVENT_READ)
sel.register(udp, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is udp:
            data, peer = udp.recvfrom(512)
            udp.sendto(banner.encode(), peer)
            continue
        conn, _ = tcp.accept()
        try:  # SO_ORIGINAL_DST (80): where a redirected connection was headed
            raw = conn.getsockopt(socket.SOL_IP, 80, 16)
            dst = f"{socket.inet_ntoa(raw[4:8])}:{struct.unpack('!H', raw[2:4])[0]}"
        except OSError:
            dst = "-"
        conn.sendall(f"{banner} {dst}".encode())
        conn.close()
"""

CLIENT = r"""
import socket, sys
proto, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    if proto == "tcp":
        s = socket.create_connection((host, port), timeout=3)
        print(s.recv(200).decode())
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3)
        s.connect((host, port))
        s.send(b"q")
        print(s.recv(200).decode())
except OSError as exc:
    print(f"error {type(exc).__name__} {exc.errno}")
"""


def _tools_missing() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux to create network namespaces (CI runs as root)"
    missing = [t for t in ("ip", "iptables-restore", "setpriv") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install -y iptables iproute2 util-linux)"
    return None


def _python_for_any_uid() -> str | None:
    """An interpreter other uids can execute (a venv under /root may not be)."""
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(candidate):
            continue
        done = subprocess.run(["setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups",
                               candidate, "-I", "-S", "-c", "pass"], capture_output=True, timeout=20, check=False)
        if done.returncode == 0:
            return candidate
    return None


def _run(*cmd: str, stdin: str | None = None) -> str:
    done = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Namespaces:
    pod: str
    net: str
    python: str
    internet_ip: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def serve(self, ns: str, host: str, port: int, banner: str) -> None:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, self.python, "-I", "-S", "-c", SERVER, host, str(port),
                                 banner], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"listener {banner} did not start: {proc.stderr.read() if proc.stderr else ''}")

    def connect(self, uid: int, proto: str, host: str, port: int) -> str:
        return _run("ip", "netns", "exec", self.pod, "setpriv", f"--reuid={uid}", f"--regid={uid}",
                    "--clear-groups", self.python, "-I", "-S", "-c", CLIENT, proto, host, str(port)).strip()

    def lock(self, lock: EgressLock) -> None:
        _run("ip", "netns", "exec", self.pod, "iptables-restore", stdin=restore_script(lock, 4))


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    reason = _tools_missing()
    if reason:
        pytest.skip(reason)
    python = _python_for_any_uid()
    if python is None:
        pytest.skip(f"no Python interpreter that uid {AGENT_UID} may execute")
    tag = uuid.uuid4().hex[:6]
    pod, net = f"tether-pod-{tag}", f"tether-net-{tag}"
    octet = int(tag[:2], 16) % 200 + 20
    ns = Namespaces(pod, net, python, internet_ip=f"10.253.{octet}.2")
    created: list[str] = []
    try:
        for name in (pod, net):
            _run("ip", "netns", "add", name)
            created.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", pod, "link", "add", f"tp{tag}", "type", "veth", "peer", "name", f"tn{tag}", "netns", net)
        _run("ip", "-n", pod, "addr", "add", f"10.253.{octet}.1/30", "dev", f"tp{tag}")
        _run("ip", "-n", net, "addr", "add", f"{ns.internet_ip}/30", "dev", f"tn{tag}")
        _run("ip", "-n", pod, "link", "set", f"tp{tag}", "up")
        _run("ip", "-n", net, "link", "set", f"tn{tag}", "up")
        ns.serve(net, ns.internet_ip, TOOL_PORT, "internet")
        ns.serve(net, ns.internet_ip, 53, "dns")
        ns.serve(pod, "127.0.0.1", PROXY_PORT, "sidecar")
        ns.serve(pod, "127.0.0.1", TPORT, "transparent")
        yield ns
    finally:
        for proc in ns.procs:
            proc.kill()
            proc.wait(timeout=10)
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)


def test_without_the_lock_every_uid_gets_out(namespaces: Namespaces) -> None:
    """The baseline: the world works, so the refusals below are the lock's doing."""
    ns = namespaces
    assert ns.connect(AGENT_UID, "tcp", ns.internet_ip, TOOL_PORT).startswith("internet")
    assert ns.connect(AGENT_UID, "udp", ns.internet_ip, 53) == "dns"


def test_explicit_lock_only_the_sidecar_uid_leaves(namespaces: Namespaces) -> None:
    ns = namespaces
    ns.lock(EgressLock(SIDECAR_UID, PROXY_PORT))

    # the agent: refused outward at once (TCP and DNS alike), but its proxy on loopback answers
    tcp = ns.connect(AGENT_UID, "tcp", ns.internet_ip, TOOL_PORT)
    assert tcp.startswith("error") and "Timeout" not in tcp, tcp
    udp = ns.connect(AGENT_UID, "udp", ns.internet_ip, 53)
    assert udp.startswith("error"), udp
    assert ns.connect(AGENT_UID, "tcp", "127.0.0.1", PROXY_PORT).startswith("sidecar")
    # root is not the sidecar either
    assert ns.connect(0, "tcp", ns.internet_ip, TOOL_PORT).startswith("error")

    # the sidecar's uid: out, TCP and DNS
    assert ns.connect(SIDECAR_UID, "tcp", ns.internet_ip, TOOL_PORT).startswith("internet")
    assert ns.connect(SIDECAR_UID, "udp", ns.internet_ip, 53) == "dns"


def test_transparent_lock_redirects_the_agent_to_the_sidecar(namespaces: Namespaces) -> None:
    ns = namespaces
    ns.lock(EgressLock(SIDECAR_UID, PROXY_PORT, TPORT))

    # the agent dials the tool; the sidecar's transparent port answers, knowing where the call was headed
    assert ns.connect(AGENT_UID, "tcp", ns.internet_ip, TOOL_PORT) == f"transparent {ns.internet_ip}:{TOOL_PORT}"
    assert ns.connect(AGENT_UID, "udp", ns.internet_ip, 53).startswith("error")
    assert ns.connect(SIDECAR_UID, "tcp", ns.internet_ip, TOOL_PORT).startswith("internet")
    # the pod's loopback is governed too, as under tether run: the sidecar decides, and the sidecar itself
    # still reaches it
    assert ns.connect(AGENT_UID, "tcp", "127.0.0.1", PROXY_PORT) == f"transparent 127.0.0.1:{PROXY_PORT}"
    assert ns.connect(SIDECAR_UID, "tcp", "127.0.0.1", PROXY_PORT).startswith("sidecar")


def test_transparent_lock_with_dns_port_answers_the_agents_dns_from_the_sidecar(namespaces: Namespaces) -> None:
    ns = namespaces
    ns.serve(ns.pod, "127.0.0.1", DNS_PORT, "sidecar-dns")
    ns.lock(EgressLock(SIDECAR_UID, PROXY_PORT, TPORT, dns_port=DNS_PORT))
    assert ns.connect(AGENT_UID, "udp", ns.internet_ip, 53) == "sidecar-dns"  # whichever resolver it asked
    assert ns.connect(SIDECAR_UID, "udp", ns.internet_ip, 53) == "dns"  # the sidecar resolves for real
    assert ns.connect(AGENT_UID, "udp", ns.internet_ip, 54).startswith("error")  # other UDP: still rejected


def test_apply_through_main_locks_a_namespace(namespaces: Namespaces) -> None:
    """The init container's own command line, run inside the pod namespace."""
    ns = namespaces
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _run("ip", "netns", "exec", ns.pod, "env", f"PYTHONPATH={repo}", sys.executable, "-m", "tether.proxy.egress",
         "--sidecar-uid", str(SIDECAR_UID), "--proxy-port", str(PROXY_PORT), "--ipv6", "auto", "--apply")
    assert ns.connect(AGENT_UID, "tcp", ns.internet_ip, TOOL_PORT).startswith("error")
    assert ns.connect(SIDECAR_UID, "tcp", ns.internet_ip, TOOL_PORT).startswith("internet")
    assert CHAIN in _run("ip", "netns", "exec", ns.pod, "iptables", "-S", "OUTPUT")
