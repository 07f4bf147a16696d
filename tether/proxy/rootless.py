"""``tether run``'s default: the command where its only way out is its sidecar, without root.

The command runs in its own user, network, mount and PID namespaces, which any user may create where the kernel
allows unprivileged user namespaces. Nothing here needs a capability on the host.

- **Network.** The namespace has its loopback and nothing else: no interface joins it to the host. Every address
  is local to it (``ip route add local default dev lo``, IPv4 and IPv6), so every ``connect()`` routes, and the
  namespace's own ``nat OUTPUT`` redirects every TCP connection to one listener and every DNS datagram to one
  resolver. Both sockets are made inside and handed to the sidecar outside (SCM_RIGHTS): the sidecar accepts on
  them, reads each connection's original destination (SO_ORIGINAL_DST, in the namespace's conntrack) and connects
  upstream from the host's network, as in its transparent mode (tether/proxy/transparent.py). So ``127.0.0.1:P`` inside
  is, through the sidecar and only where the catalog grants it, ``127.0.0.1:P`` on the host, under the same name.
  Other protocols (UDP but DNS, ICMP, raw sockets) meet only the namespace's loopback.
- **Trust.** The system's CA bundle files and certificate directory (and ``certifi`` bundles of Pythons on PATH,
  Java's ``cacerts``) show a copy with tether's CA added, bind-mounted over them, and every ``node`` on PATH runs
  with ``NODE_EXTRA_CA_CERTS`` set: a client verifies the sidecar with no variable set.
- **Authority.** The state root (the sidecar's key, CA key, spool, captures), the key files and secret files are
  covered by empty mounts.
- **Processes.** The command runs one user namespace deeper, as the invoking user with no capability: it cannot
  change the rules (the network namespace belongs to the outer user namespace, where it holds nothing) nor lift
  the covers (mounts inherited by a less privileged mount namespace are locked together). PID 1 of the new PID
  namespace is a small init that forwards signals and reaps; when the command ends, it ends, and the kernel takes
  whatever the command left running with it. A fresh ``/proc`` shows the command its own processes only, and the
  processes that hold namespace rights are not dumpable (no ptrace, no ``/proc/PID/mem``).

Outside, :class:`Enclosure` starts the inside (``python -I -S tether/proxy/inside.py FD``, a fresh interpreter that
loads only C modules of the standard library: tether/proxy/inside.py) and talks to it over a socket pair: the inside
sends the two sockets (or why it could not), the outside sends the :class:`Plan` (mounts, covers, the command), the
inside answers once the command runs. The plan is pure data.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tether.capability.errors import ISOLATION_UNAVAILABLE, TetherError

from . import inside
from .inside import network_commands  # noqa: F401 - the network's commands are the inside's; named here too

LISTEN_PORT = inside.LISTEN_PORT  # inside the namespace: every TCP connection is redirected here
DNS_ANSWER = "100.64.0.1"  # every name, inside; shared address space, so no catalog names it by accident
ENABLE_HINT = ("enable unprivileged user namespaces (sysctl -w user.max_user_namespaces=15000; Debian's "
               "kernel.unprivileged_userns_clone=1; Ubuntu's kernel.apparmor_restrict_unprivileged_userns=0), "
               "install iproute2 and iptables (nf_tables), or run with --cooperative to accept that programs "
               "ignoring the proxy variables are not governed")

# The system trust stores of Debian/Ubuntu, RHEL/Fedora, SUSE, Alpine, and OpenSSL's own defaults.
TRUST_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
               "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", "/etc/ssl/ca-bundle.pem", "/etc/ssl/cert.pem",
               "/usr/lib/ssl/cert.pem", "/etc/pki/tls/cert.pem")
TRUST_DIRS = ("/etc/ssl/certs", "/etc/pki/tls/certs", "/usr/lib/ssl/certs")
JAVA_STORES = ("/etc/ssl/certs/java/cacerts", "/etc/pki/ca-trust/extracted/java/cacerts")


class IsolationUnavailable(TetherError):
    code = ISOLATION_UNAVAILABLE


@dataclass(frozen=True)
class Mount:
    source: str  # a file or directory to show at target; "" for an empty cover
    target: str
    directory: bool


@dataclass(frozen=True)
class Plan:
    """What the inside does once the sidecar serves: the mounts, then the command."""

    command: list[str]
    env: dict[str, str]
    cwd: str
    mounts: list[Mount] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> Plan:
        return cls(doc["command"], doc["env"], doc["cwd"], [Mount(**m) for m in doc["mounts"]])


def trust_mounts(ca_pem: bytes, workdir: Path, path_dirs: list[str], cache: Path | None = None) -> list[Mount]:
    """Copies of the system's trust stores with tether's CA added, as mounts over the originals: bundle files,
    certificate directories (with the CA under its subject hash where ``openssl`` can compute it), Java's
    ``cacerts`` (a PKCS#12 trust store, which Java reads wherever it expects JKS), and certifi's bundles in the
    Pythons on PATH. Written under ``workdir``, or kept in ``cache`` (the state dir) for as long as the CA and
    the system's stores stay what they were, so that a run does not copy them again."""
    if cache is None:
        return _build_trust(ca_pem, workdir / "trust", path_dirs, None)
    key = _trust_key(ca_pem, path_dirs)
    kept = cache / f"trust-{key}"
    manifest = kept / "mounts.json"
    if not manifest.exists():
        cache.mkdir(mode=0o700, exist_ok=True)
        building = cache / f".trust-{key}-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        mounts = [Mount(m.source.replace(str(building), str(kept), 1), m.target, m.directory)
                  for m in _build_trust(ca_pem, building, path_dirs, cache)]
        (building / "mounts.json").write_text(json.dumps([asdict(m) for m in mounts]))
        try:
            os.rename(building, kept)
        except OSError:  # another run kept the same one first
            shutil.rmtree(building, ignore_errors=True)
        for old in cache.glob("trust-*"):
            if old != kept:
                shutil.rmtree(old, ignore_errors=True)
    return [Mount(**m) for m in json.loads(manifest.read_text())]


def _trust_key(ca_pem: bytes, path_dirs: list[str]) -> str:
    """What the copies depend on: the CA, the system's bundle and what its certificate directories hold."""
    import hashlib

    digest = hashlib.sha256(ca_pem)
    for name in (*TRUST_FILES, *JAVA_STORES, *_certifi_bundles(path_dirs)):
        with contextlib.suppress(OSError):
            st = os.stat(name)
            digest.update(f"{name}:{os.path.realpath(name)}:{st.st_size}:{st.st_mtime_ns}".encode())
    for directory in TRUST_DIRS:
        with contextlib.suppress(OSError):
            digest.update(f"{directory}:{sorted(os.listdir(directory))}".encode())
    return digest.hexdigest()[:24]


def _certifi_bundles(path_dirs: list[str]) -> list[str]:
    return sorted({os.path.realpath(p) for d in path_dirs
                   for p in glob.glob(os.path.join(d, "..", "lib", "python3*", "site-packages", "certifi",
                                                   "cacert.pem"))})


def _build_trust(ca_pem: bytes, out: Path, path_dirs: list[str], cache: Path | None) -> list[Mount]:
    out.mkdir(mode=0o755)
    truststore = _java_truststore(ca_pem, cache) if any(os.path.isfile(j) for j in JAVA_STORES) else b""
    mounts: list[Mount] = []
    covered: list[str] = []
    for i, name in enumerate(dict.fromkeys(os.path.realpath(d) for d in TRUST_DIRS if os.path.isdir(d))):
        copy = out / f"dir{i}"
        _copy_tree(Path(name), copy, ca_pem, truststore)
        (copy / "tether-ca.pem").write_bytes(ca_pem)
        digest = _subject_hash(copy / "tether-ca.pem")
        if digest:
            for n in range(10):
                if not (copy / f"{digest}.{n}").exists():
                    (copy / f"{digest}.{n}").symlink_to("tether-ca.pem")
                    break
        mounts.append(Mount(str(copy), name, True))
        covered.append(name + os.sep)
    files = [os.path.realpath(f) for f in (*TRUST_FILES, *JAVA_STORES) if os.path.isfile(f)]
    files += _certifi_bundles(path_dirs)
    for i, name in enumerate(dict.fromkeys(files)):
        if any(name.startswith(c) for c in covered):
            continue  # its directory's copy already holds the store with the CA
        copy = out / f"store{i}"
        copy.write_bytes(truststore if name in JAVA_STORES else _with_ca(Path(name).read_bytes(), ca_pem))
        mounts.append(Mount(str(copy), name, False))
    return mounts


def _copy_tree(source: Path, copy: Path, ca_pem: bytes, truststore: bytes) -> None:
    """``source`` as a new directory: what lies elsewhere linked, what lies in it copied (its bundles and Java
    stores with the CA added), so that the copy mounted over ``source`` never links into itself."""
    copy.mkdir(mode=0o755)
    for entry in os.scandir(source):
        real = os.path.realpath(entry.path)
        if not os.path.exists(real):
            continue  # a dangling link: nothing to trust there
        if not (real + os.sep).startswith(str(source) + os.sep):
            (copy / entry.name).symlink_to(real)
        elif os.path.isdir(real):
            _copy_tree(Path(real), copy / entry.name, ca_pem, truststore)
        elif real in JAVA_STORES:
            (copy / entry.name).write_bytes(truststore)
        else:
            data = Path(real).read_bytes()
            (copy / entry.name).write_bytes(_with_ca(data, ca_pem) if _is_bundle(data) else data)


def _java_truststore(ca_pem: bytes, cache: Path | None) -> bytes:
    """The system's roots and the CA as a password-less PKCS#12 trust store (Java 9+ reads it as ``cacerts``),
    kept in ``cache`` by content (making one takes a moment)."""
    import hashlib
    import warnings

    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import NoEncryption, pkcs12

    system = next((Path(f).read_bytes() for f in TRUST_FILES if os.path.isfile(f)), b"")
    pems = _with_ca(system, ca_pem)
    kept = cache / f"java-{hashlib.sha256(pems).hexdigest()[:32]}.p12" if cache is not None else None
    if kept is not None and kept.exists():
        return kept.read_bytes()
    certs = []
    for block in pems.split(b"-----END CERTIFICATE-----")[:-1]:
        with warnings.catch_warnings(), contextlib.suppress(ValueError):
            warnings.simplefilter("ignore")  # a root with a non-positive serial is still the system's to trust
            certs.append(x509.load_pem_x509_certificate(block + b"-----END CERTIFICATE-----\n"))
    store = pkcs12.serialize_java_truststore(
        [pkcs12.PKCS12Certificate(c, f"cert{i}".encode()) for i, c in enumerate(certs)], NoEncryption())
    if kept is not None:
        kept.parent.mkdir(mode=0o700, exist_ok=True)
        kept.write_bytes(store)
    return store


def node_mounts(bundle: Path, workdir: Path, path_dirs: list[str]) -> list[Mount]:
    """Node trusts only its bundled roots and ``NODE_EXTRA_CA_CERTS``, so a Node child whose environment was wiped
    (an SDK's stdio server) would not trust the sidecar. Every ``node`` on PATH is shown as a two-line wrapper that
    sets the variable when it is missing and runs the real binary (bound beside it). Nothing is wrapped where the
    work dir's file system is ``noexec`` (the wrapper could not run there)."""
    if os.statvfs(workdir).f_flag & os.ST_NOEXEC:
        return []
    binaries = dict.fromkeys(os.path.realpath(os.path.join(d, "node")) for d in path_dirs
                             if os.access(os.path.join(d, "node"), os.X_OK))
    mounts: list[Mount] = []
    for i, real in enumerate(b for b in binaries if os.path.isfile(b)):
        home = workdir / "node" / str(i)
        home.mkdir(parents=True, mode=0o755)
        (home / "node.real").touch(mode=0o755)  # where the real binary is bound, before the wrapper covers it
        wrapper = home / "node"
        wrapper.write_text(f'#!/bin/sh\nNODE_EXTRA_CA_CERTS="${{NODE_EXTRA_CA_CERTS:-{bundle}}}" '
                           f'exec "{home / "node.real"}" "$@"\n')
        wrapper.chmod(0o755)
        mounts += [Mount(real, str(home / "node.real"), False), Mount(str(wrapper), real, False)]
    return mounts


def bundle_path(workdir: Path, ca_pem: bytes) -> Path:
    """One bundle the command's CA variables name: the system's roots and tether's CA."""
    system = next((Path(f).read_bytes() for f in TRUST_FILES if os.path.isfile(f)), b"")
    path = workdir / "ca-bundle.pem"
    path.write_bytes(_with_ca(system, ca_pem))
    return path


def cover_mounts(paths: list[Path], workdir: Path) -> list[Mount]:
    """Empty covers over what the command must not read: a directory gets an empty tmpfs, a file an empty file."""
    empty = workdir / "empty"
    empty.touch(mode=0o444)
    seen = dict.fromkeys(os.path.realpath(p) for p in paths if os.path.exists(p))
    dirs = [p for p in seen if os.path.isdir(p)]
    inside = [p for p in seen if any(p != d and p.startswith(d + os.sep) for d in dirs)]  # covered with its dir
    return [Mount("", p, True) if p in dirs else Mount(str(empty), p, False) for p in seen if p not in inside]


def resolver_mount(workdir: Path) -> list[Mount]:
    conf = workdir / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:2 attempts:2\n")
    target = os.path.realpath("/etc/resolv.conf")
    return [Mount(str(conf), target, False)] if os.path.isfile(target) else []


def _is_bundle(data: bytes) -> bool:
    return data.count(b"-----BEGIN CERTIFICATE-----") > 1


def _with_ca(bundle: bytes, ca_pem: bytes) -> bytes:
    return bundle.rstrip(b"\n") + b"\n" + ca_pem if bundle.strip() else ca_pem


def _subject_hash(pem: Path) -> str | None:
    if shutil.which("openssl") is None:
        return None
    done = subprocess.run(["openssl", "x509", "-subject_hash", "-noout", "-in", str(pem)], capture_output=True,
                          text=True, timeout=10, check=False)
    return done.stdout.strip() or None


# -- the wire between outside and inside: length-prefixed JSON, sockets alongside the first message --------------
MAX_MESSAGE = 16 << 20  # a plan or a delegation request: a command line and an environment


def send(chan: socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(doc).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(chan, [frame[:4]], fds)
        chan.sendall(frame[4:])
    else:
        chan.sendall(frame)


def receive(chan: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(chan, 4, 4)
    head += inside.read_exactly(chan, 4 - len(head))
    (size,) = struct.unpack("!I", head)
    if size > MAX_MESSAGE:  # the other side may be the enclosed command itself (tether/cli/delegation.py)
        raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    return json.loads(inside.read_exactly(chan, size)), fds


# -- outside ----------------------------------------------------------------------------------------------------
def tools() -> tuple[str, str | None]:
    """The iptables (nf_tables: the legacy backend cannot be used from a user namespace) and ip6tables to use."""
    if shutil.which("ip") is None:
        raise IsolationUnavailable(f"enforcement needs the ip command (iproute2): {ENABLE_HINT}")
    for v4, v6 in (("iptables-nft", "ip6tables-nft"), ("iptables", "ip6tables")):
        path = shutil.which(v4)
        if path is None:
            continue
        version = subprocess.run([path, "-V"], capture_output=True, text=True, check=False).stdout
        if "nf_tables" in version:
            return path, shutil.which(v6)
    raise IsolationUnavailable(f"enforcement needs iptables with the nf_tables backend: {ENABLE_HINT}")


class Enclosure:
    """The namespaces of one ``tether run``, seen from outside: their two sockets (for the sidecar), then the
    command in them."""

    def __init__(self, process: subprocess.Popen, chan: socket.socket, listener: int, resolver: int) -> None:
        self.process = process
        self.chan = chan
        self.listener = listener
        self.resolver = resolver
        self.workdir = Path(tempfile.mkdtemp(prefix="tether-run-"))
        os.chmod(self.workdir, 0o755)

    @classmethod
    def open(cls, timeout_s: float = 20.0) -> Enclosure:
        if sys.platform != "linux":
            raise IsolationUnavailable(f"enforcement needs Linux namespaces; this is {sys.platform}: run with "
                                       "--cooperative to accept that programs ignoring the proxy variables are "
                                       "not governed")
        iptables, ip6tables = tools()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.settimeout(timeout_s)
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C"}
        process = subprocess.Popen([sys.executable, "-I", "-S", inside.__file__, str(theirs.fileno()), iptables,
                                     ip6tables or ""], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        try:
            doc, fds = inside.receive_values(ours)
        except (OSError, EOFError, ValueError) as exc:
            process.kill()
            process.wait()
            raise IsolationUnavailable(f"the enclosure did not start ({exc}): {ENABLE_HINT}") from None
        if "error" in doc:
            process.wait()
            raise IsolationUnavailable(f"cannot enclose the command: {doc['error']}: {ENABLE_HINT}")
        return cls(process, ours, fds[0], fds[1])

    def start(self, plan: Plan) -> None:
        """Mount and run the command; raises when the inside could not (the command did not start)."""
        inside.send_values(self.chan, plan.to_wire())
        try:
            doc, _ = inside.receive_values(self.chan)
        except (OSError, EOFError, ValueError) as exc:
            raise IsolationUnavailable(f"the enclosure stopped before the command started ({exc})") from None
        if "error" in doc:
            raise IsolationUnavailable(f"cannot enclose the command: {doc['error']}")

    def handed_over(self) -> None:
        """The sidecar serving in this process owns the listener and resolver now (it closes them)."""
        self.listener = self.resolver = -1

    def close_sockets(self) -> None:
        """Close the listener and resolver where no sidecar took them."""
        for fd in (self.listener, self.resolver):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.listener = self.resolver = -1

    def destroy(self) -> None:
        self.close_sockets()
        if self.process.poll() is None:
            self.process.kill()  # its init dies with it (PDEATHSIG), and the kernel empties the namespace
            self.process.wait()
        self.chan.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
