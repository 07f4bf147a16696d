"""The egress lock of an agent pod: packet-filter rules under which only the sidecar's uid leaves the pod.

A pod's containers share one network namespace, so the sidecar cannot stop the agent container from
dialling out around it; the kernel can. An init container (root, ``NET_ADMIN``) runs this module before
the sidecar and the agent start, and installs, in the pod's namespace:

- loopback and established/related traffic pass (the agent reaches the sidecar on ``127.0.0.1``, answers
  to inbound connections such as kubelet probes go out);
- every packet a socket owned by the sidecar's uid sends passes (``-m owner --uid-owner UID``): the
  sidecar reaches the control plane, DNS and the tools;
- explicit proxy mode (the default): every other new outbound connection, TCP, UDP (DNS included) or
  anything else, is rejected at once, so an agent that ignores ``HTTPS_PROXY`` fails fast and loudly;
- transparent mode: other uids' TCP is redirected (``nat OUTPUT REDIRECT``) to the sidecar's transparent port
  instead, loopback included (as under ``tether run``: a service on the pod's own 127.0.0.1 is reached through
  the sidecar, only where the catalog grants it); with ``--dns-port``, their DNS goes to the sidecar's
  resolver, which answers every name and forwards nothing (no DNS channel out), as under ``tether run``; the
  rest is rejected as above.

The rules are pure data (:func:`rule_args`, :func:`restore_script`); only :func:`apply` runs a command.
``python -m tether.proxy.egress --sidecar-uid 10001 --proxy-port 8080 [--transparent] [--apply|--print]``.

What this does not stop is said in docs/deploy.md: a process in the pod running as the sidecar's uid, or
holding ``NET_ADMIN``/``NET_RAW``, is outside the lock; the pod spec must prevent both.
"""

from __future__ import annotations

import argparse
import ipaddress
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tether.capability.errors import TetherError

EGRESS_FAILED = "tether.egress_failed"
CHAIN = "TETHER_OUTPUT"
NAT_CHAIN = "TETHER_REDIRECT"
DEFAULT_TRANSPARENT_PORT = 15001
# Neighbour discovery is sent by the kernel, not by a socket: without it IPv6 stops working for the sidecar too.
NDP_TYPES = ("router-solicitation", "neighbour-solicitation", "neighbour-advertisement")
RESTORE = {4: "iptables-restore", 6: "ip6tables-restore"}


class EgressError(TetherError):
    """The lock cannot be built or installed; the pod must not start without it."""

    code = EGRESS_FAILED


@dataclass(frozen=True)
class EgressLock:
    """What the lock allows. ``transparent_port`` set means transparent mode."""

    sidecar_uid: int
    proxy_port: int = 8080
    transparent_port: int | None = None
    agent_dns: tuple[str, ...] = ()  # resolvers other uids may query (transparent mode needs names)
    dns_port: int | None = None  # transparent mode: other uids' DNS is redirected to the sidecar's resolver here

    def __post_init__(self) -> None:
        if self.sidecar_uid <= 0:
            raise EgressError(f"--sidecar-uid {self.sidecar_uid}: the sidecar must run as a fixed non-root uid "
                              "(root is exempt from nothing and would make the lock meaningless)")
        if self.dns_port is not None and self.transparent_port is None:
            raise EgressError("--dns-port redirects DNS to the sidecar in transparent mode only: add --transparent")
        for name, port in (("proxy", self.proxy_port), ("transparent", self.transparent_port),
                           ("dns", self.dns_port)):
            if port is not None and not 0 < port < 65536:
                raise EgressError(f"the {name} port {port} is out of range 1-65535")
        if self.transparent_port is not None and self.transparent_port == self.proxy_port:
            raise EgressError("the transparent port must differ from the explicit proxy port")
        for address in self.agent_dns:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise EgressError(f"--agent-dns {address}: expected an IP address") from None

    @property
    def transparent(self) -> bool:
        return self.transparent_port is not None

    def resolvers(self, family: int) -> list[str]:
        return [a for a in self.agent_dns if ipaddress.ip_address(a).version == family]


def _filter_rules(lock: EgressLock, family: int) -> list[list[str]]:
    uid = str(lock.sidecar_uid)
    rules = [
        ["-A", "OUTPUT", "-j", CHAIN],
        ["-A", CHAIN, "-o", "lo", "-j", "ACCEPT"],
        ["-A", CHAIN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-A", CHAIN, "-m", "owner", "--uid-owner", uid, "-j", "ACCEPT"],
    ]
    if lock.transparent_port is not None:
        # A packet redirected in nat OUTPUT keeps the interface it was routed to first, so "-o lo" misses it.
        loopback = "127.0.0.1" if family == 4 else "::1"
        rules.append(["-A", CHAIN, "-d", loopback, "-p", "tcp", "--dport", str(lock.transparent_port),
                      "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"])
        if lock.dns_port is not None and family == 4:
            rules.append(["-A", CHAIN, "-d", loopback, "-p", "udp", "--dport", str(lock.dns_port),
                          "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"])
    if family == 6:
        rules += [["-A", CHAIN, "-p", "ipv6-icmp", "--icmpv6-type", kind, "-j", "ACCEPT"] for kind in NDP_TYPES]
    for resolver in lock.resolvers(family):
        rules += [["-A", CHAIN, "-d", resolver, "-p", proto, "--dport", "53", "-j", "ACCEPT"]
                  for proto in ("udp", "tcp")]
    unreachable = "icmp-port-unreachable" if family == 4 else "icmp6-port-unreachable"
    rules += [
        ["-A", CHAIN, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
        ["-A", CHAIN, "-j", "REJECT", "--reject-with", unreachable],
    ]
    return rules


def _nat_rules(lock: EgressLock, family: int) -> list[list[str]]:
    if lock.transparent_port is None:
        return []
    # The sidecar's resolver listens on IPv4 loopback: IPv6 DNS of other uids is rejected by the filter instead.
    dns = lock.dns_port is not None and family == 4
    return [
        ["-A", "OUTPUT", "-p", "tcp", "-j", NAT_CHAIN],
        *([["-A", "OUTPUT", "-p", "udp", "--dport", "53", "-j", NAT_CHAIN]] if dns else []),
        ["-A", NAT_CHAIN, "-m", "owner", "--uid-owner", str(lock.sidecar_uid), "-j", "RETURN"],
        *[["-A", NAT_CHAIN, "-d", r, "-p", "tcp", "--dport", "53", "-j", "RETURN"] for r in lock.resolvers(family)],
        *([["-A", NAT_CHAIN, "-p", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", str(lock.dns_port)]]
          if dns else []),
        ["-A", NAT_CHAIN, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(lock.transparent_port)],
    ]


def tables(lock: EgressLock, family: int = 4) -> dict[str, list[list[str]]]:
    """The rules per table, each an ``iptables`` argument list without ``-t``."""
    if family not in RESTORE:
        raise EgressError(f"address family {family}: expected 4 or 6")
    out = {"filter": _filter_rules(lock, family)}
    if lock.transparent:
        out["nat"] = _nat_rules(lock, family)
    return out


def rule_args(lock: EgressLock, family: int = 4) -> list[list[str]]:
    """The lock as ``iptables``/``ip6tables`` invocations (arguments after the command), chains created first."""
    args: list[list[str]] = []
    for table, rules in tables(lock, family).items():
        args.append(["-t", table, "-N", CHAIN if table == "filter" else NAT_CHAIN])
        args += [["-t", table, *rule] for rule in rules]
    return args


_BUILTIN = {"filter": ("INPUT", "FORWARD", "OUTPUT"), "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")}


def restore_script(lock: EgressLock, family: int = 4) -> str:
    """The lock as an ``iptables-restore`` script. It replaces the tables it names: the pod's namespace is ours."""
    mode = f"transparent, redirect to :{lock.transparent_port}" if lock.transparent else \
        f"explicit proxy on 127.0.0.1:{lock.proxy_port}"
    lines = [f"# tether egress lock (IPv{family}): only uid {lock.sidecar_uid} leaves the pod; {mode}"]
    for table, rules in tables(lock, family).items():
        lines.append(f"*{table}")
        lines += [f":{chain} ACCEPT [0:0]" for chain in _BUILTIN[table]]
        lines.append(f":{CHAIN if table == 'filter' else NAT_CHAIN} - [0:0]")
        lines += [" ".join(rule) for rule in rules]
        lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def ipv6_enabled() -> bool:
    """Whether this namespace has IPv6 at all (if it does, it must be locked too)."""
    path = Path("/proc/net/if_inet6")
    return path.exists() and bool(path.read_text().strip())


def apply(lock: EgressLock, families: Sequence[int], *, restore: dict[int, str] | None = None,
          timeout_s: float = 30.0) -> None:
    """Install the lock with ``iptables-restore`` (and ``ip6tables-restore``). Raises EgressError on any failure."""
    commands = {**RESTORE, **(restore or {})}
    for family in families:
        command = commands[family]
        try:
            done = subprocess.run([command], input=restore_script(lock, family), capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except FileNotFoundError:
            raise EgressError(f"{command} is not installed; the image needs the iptables package") from None
        except subprocess.TimeoutExpired:
            raise EgressError(f"{command} did not finish within {timeout_s:.0f}s") from None
        if done.returncode != 0:
            raise EgressError(f"{command} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}; "
                              "the container needs NET_ADMIN (and NET_RAW for the legacy backend)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tether.proxy.egress",
                                description="Lock an agent pod's egress so that only the sidecar's uid leaves it.")
    p.add_argument("--sidecar-uid", type=int, required=True, help="the uid the sidecar runs as (e.g. 10001)")
    p.add_argument("--proxy-port", type=int, default=8080, help="the sidecar's explicit proxy port")
    p.add_argument("--transparent", action="store_true", help="redirect other uids' TCP to the sidecar")
    p.add_argument("--transparent-port", type=int, default=DEFAULT_TRANSPARENT_PORT)
    p.add_argument("--agent-dns", action="append", default=[], metavar="IP",
                   help="a resolver the agent may query directly (a DNS channel; --dns-port instead closes it)")
    p.add_argument("--dns-port", type=int, default=None, metavar="PORT",
                   help="transparent mode: send other uids' DNS to the sidecar's resolver on 127.0.0.1:PORT "
                        "(tether sidecar --dns-listen 127.0.0.1:PORT), which answers every name itself")
    p.add_argument("--ipv6", choices=["auto", "on", "off"], default="auto",
                   help="lock IPv6 too (auto: when the namespace has IPv6)")
    p.add_argument("--iptables-restore", default=RESTORE[4], help="e.g. iptables-legacy-restore")
    p.add_argument("--ip6tables-restore", default=RESTORE[6])
    action = p.add_mutually_exclusive_group()
    action.add_argument("--apply", action="store_true", help="install the rules (default: print them)")
    action.add_argument("--print", action="store_true", help="print the iptables-restore script(s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lock = EgressLock(args.sidecar_uid, args.proxy_port,
                          args.transparent_port if args.transparent else None, tuple(args.agent_dns), args.dns_port)
        families = [4] + ([6] if args.ipv6 == "on" or (args.ipv6 == "auto" and ipv6_enabled()) else [])
        if not args.apply:
            sys.stdout.write("\n".join(restore_script(lock, f) for f in families))
            return 0
        apply(lock, families, restore={4: args.iptables_restore, 6: args.ip6tables_restore})
    except EgressError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    print(f"tether: egress locked (IPv{' and IPv'.join(map(str, families))}): only uid {lock.sidecar_uid} "
          f"leaves this pod; others {'are redirected to' if lock.transparent else 'may reach only'} "
          f"127.0.0.1:{lock.transparent_port if lock.transparent else lock.proxy_port}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
