"""``tether run --isolate``: the command in a network namespace whose only way out is its sidecar.

Layout (Linux, run as root): a namespace ``tether-TAG`` joined to the host by a veth pair on a /30 out of
100.64.0.0/10. Inside, a default route to the host end; IPv6 off (at both ends: no link-local path around
the rules). On the host, for packets arriving from that veth only:

- ``nat PREROUTING``: TCP to anywhere is redirected to the sidecar's transparent listener on the host end
  (the original destination stays readable with SO_ORIGINAL_DST); UDP to the host end's port 53 goes to the
  sidecar's resolver, which answers every name with the host end's address (tether/proxy/transparent.py);
- ``filter INPUT``: only those two redirected flows are accepted, everything else from the veth is dropped
  (other UDP, ICMP, any other protocol, any host service);
- ``filter FORWARD``: nothing from or to the veth is routed, whatever the host's ``ip_forward``.

The command runs as an unprivileged user (``nobody`` unless ``--user``; never root) with ``setpriv
--clear-groups --no-new-privs``, so it cannot read the sidecar's key, CA key or secrets (root-owned 0600, in
a 0700 state dir: checked before starting) and cannot change the namespace's rules. Its resolver and hosts
file (``/etc/netns/NAME/``, bind-mounted by ``ip netns exec``) name only the sidecar.

The plan is pure data (:class:`Plan`: addresses, the commands and rules); :class:`Isolation` runs it and
undoes it, in reverse, whatever happened in between.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tether.capability.errors import TetherError

log = logging.getLogger("tether.isolate")

ISOLATE_FAILED = "tether.isolate_failed"
TRANSPARENT_PORT = 15001
DNS_PORT = 15053
POOL = ipaddress.ip_network("100.64.0.0/10")  # shared address space: rarely a real route on a host


class IsolateError(TetherError):
    code = ISOLATE_FAILED


@dataclass(frozen=True)
class Plan:
    tag: str
    subnet: ipaddress.IPv4Network
    tport: int = TRANSPARENT_PORT
    dns_port: int = DNS_PORT

    @property
    def netns(self) -> str:
        return f"tether-{self.tag}"

    @property
    def veth_host(self) -> str:
        return f"tth{self.tag}"

    @property
    def veth_ns(self) -> str:
        return f"ttn{self.tag}"

    @property
    def host_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def ns_ip(self) -> str:
        return str(self.subnet.network_address + 2)

    @property
    def chain(self) -> str:
        return f"TETHER_ISO_{self.tag}"

    def setup(self) -> list[list[str]]:
        """The namespace and its link, as commands."""
        n, plen = self.netns, self.subnet.prefixlen
        return [
            ["ip", "netns", "add", n],
            ["ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns, "netns", n],
            ["sysctl", "-q", "-w", f"net.ipv6.conf.{self.veth_host}.disable_ipv6=1"],
            ["ip", "netns", "exec", n, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"],
            ["ip", "netns", "exec", n, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1"],
            ["ip", "addr", "add", f"{self.host_ip}/{plen}", "dev", self.veth_host],
            ["ip", "link", "set", self.veth_host, "up"],
            ["ip", "-n", n, "link", "set", "lo", "up"],
            ["ip", "-n", n, "addr", "add", f"{self.ns_ip}/{plen}", "dev", self.veth_ns],
            ["ip", "-n", n, "link", "set", self.veth_ns, "up"],
            ["ip", "-n", n, "route", "add", "default", "via", self.host_ip],
        ]

    def rules(self) -> list[list[str]]:
        """The host's rules for this veth, as ``iptables`` arguments (chains first, jumps last)."""
        c, ip = self.chain, self.host_ip
        return [
            ["-t", "filter", "-N", c],
            ["-t", "filter", "-A", c, "-p", "tcp", "-d", ip, "--dport", str(self.tport),
             "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"],
            ["-t", "filter", "-A", c, "-p", "udp", "-d", ip, "--dport", str(self.dns_port),
             "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"],
            ["-t", "filter", "-A", c, "-j", "DROP"],
            ["-t", "nat", "-N", c],
            ["-t", "nat", "-A", c, "-p", "udp", "-d", ip, "--dport", "53", "-j", "REDIRECT",
             "--to-ports", str(self.dns_port)],
            ["-t", "nat", "-A", c, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(self.tport)],
            *self.jumps("-I"),
        ]

    def jumps(self, action: str) -> list[list[str]]:
        at = ["1"] if action == "-I" else []
        c, v = self.chain, self.veth_host
        return [
            ["-t", "filter", action, "INPUT", *at, "-i", v, "-j", c],
            ["-t", "filter", action, "FORWARD", *at, "-i", v, "-j", "DROP"],
            ["-t", "filter", action, "FORWARD", *at, "-o", v, "-j", "DROP"],
            ["-t", "nat", action, "PREROUTING", *at, "-i", v, "-j", c],
        ]

    def teardown_rules(self) -> list[list[str]]:
        return [*self.jumps("-D"), ["-t", "filter", "-F", self.chain], ["-t", "filter", "-X", self.chain],
                ["-t", "nat", "-F", self.chain], ["-t", "nat", "-X", self.chain]]

    def resolv_conf(self) -> str:
        return f"nameserver {self.host_ip}\noptions timeout:2 attempts:2\n"

    @staticmethod
    def hosts() -> str:
        # Only the namespace's own loopback by name: every other name goes to the sidecar's resolver.
        return "127.0.0.1\tlocalhost\n"


def pick_plan(used: list[ipaddress.IPv4Network], rng: random.Random | None = None) -> Plan:
    rng = rng or random.SystemRandom()
    for _ in range(64):
        index = rng.randrange(POOL.num_addresses // 4)
        subnet = ipaddress.ip_network(f"{POOL.network_address + index * 4}/30")
        if not any(subnet.overlaps(u) for u in used):
            return Plan(tag=os.urandom(3).hex(), subnet=subnet)
    raise IsolateError("no free /30 in 100.64.0.0/10 for the isolated namespace")


def host_networks() -> list[ipaddress.IPv4Network]:
    done = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False)
    nets = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def lookup(cls, name: str | None) -> User:
        name = name or "nobody"
        try:
            entry = pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
        except KeyError:
            raise IsolateError(f"--user {name}: no such user (create one, e.g. useradd --system tether-agent)") \
                from None
        if entry.pw_uid == 0:
            raise IsolateError(f"--user {name} is root: the isolated command must not be able to read the "
                               "sidecar's key or change its namespace's rules")
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def readable_by(path: Path, user: User) -> bool:
    """Whether ``user`` (with no supplementary groups, as setpriv --clear-groups runs it) could read ``path``:
    the file's own bits and every directory on the way."""
    path = path.resolve()
    for part in [*reversed(path.parents), path]:
        st = part.stat()
        need = stat.S_IXUSR if part != path else stat.S_IRUSR
        if st.st_uid == user.uid:
            ok = st.st_mode & need
        elif st.st_gid == user.gid:
            ok = st.st_mode & (need >> 3)
        else:
            ok = st.st_mode & (need >> 6)
        if not ok:
            return False
    return True


def require() -> None:
    if not os.uname().sysname == "Linux":
        raise IsolateError("--isolate needs Linux (network namespaces and iptables)")
    if os.geteuid() != 0:
        raise IsolateError("--isolate needs root: it creates a network namespace and host rules (CAP_NET_ADMIN) "
                           "and runs the command as another user (CAP_SETUID, CAP_SETGID)")
    missing = [t for t in ("ip", "iptables", "setpriv", "sysctl") if shutil.which(t) is None]
    if missing:
        raise IsolateError(f"--isolate needs {', '.join(missing)} (apt-get install iproute2 iptables util-linux "
                           "procps)")


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise IsolateError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")


@dataclass
class Isolation:
    plan: Plan
    user: User
    workdir: Path  # world-readable: the CA certificate the command trusts, and its home
    _undo: list[list[str]] = field(default_factory=list)

    @classmethod
    def create(cls, user: str | None) -> Isolation:
        require()
        who = User.lookup(user)
        plan = pick_plan(host_networks())
        iso = cls(plan, who, Path(f"/tmp/tether-isolate-{plan.tag}"))
        try:
            iso._build()
        except BaseException:
            iso.destroy()
            raise
        return iso

    def _build(self) -> None:
        p = self.plan
        for cmd in p.setup():
            _run(cmd)
            if cmd[:3] == ["ip", "netns", "add"]:
                self._undo.append(["ip", "netns", "del", p.netns])
        etc = Path("/etc/netns") / p.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(p.resolv_conf())
        (etc / "hosts").write_text(p.hosts())
        for args in p.rules():
            _run(["iptables", "-w", *args])
        self.workdir.mkdir(mode=0o755)
        os.chmod(self.workdir, 0o755)
        home = self.workdir / "home"
        home.mkdir(mode=0o700)
        os.chown(home, self.user.uid, self.user.gid)
        log.info("isolated namespace %s: %s (host end %s)", p.netns, p.subnet, p.host_ip)

    def trust(self, ca_cert: Path) -> Path:
        """A copy of the sidecar's CA certificate the command can read (the state dir is closed to it)."""
        out = self.workdir / "ca.pem"
        shutil.copyfile(ca_cert, out)
        os.chmod(out, 0o644)
        return out

    def check_unreadable(self, paths: list[Path]) -> None:
        for path in paths:
            if path.exists() and readable_by(path, self.user):
                raise IsolateError(f"{path} is readable by {self.user.name}, the user the isolated command runs "
                                   f"as: make it root's, mode 0600 (chmod 600 {path})")

    def wrap(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.plan.netns, "setpriv", f"--reuid={self.user.uid}",
                f"--regid={self.user.gid}", "--clear-groups", "--no-new-privs", "--", *command]

    def destroy(self) -> None:
        """Undo everything, each step on its own: a step that fails does not keep the others from running."""
        p = self.plan
        pids = subprocess.run(["ip", "netns", "pids", p.netns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():  # what the command left running in the namespace goes with it
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        for args in p.teardown_rules():
            subprocess.run(["iptables", "-w", *args], capture_output=True, check=False)
        for cmd in reversed(self._undo):
            subprocess.run(cmd, capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", p.veth_host], capture_output=True, check=False)
        shutil.rmtree(Path("/etc/netns") / p.netns, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
