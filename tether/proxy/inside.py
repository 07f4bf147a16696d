"""The inside of an enforced ``tether run``'s enclosure (tether/proxy/rootless.py has the design): two small
processes per agent for as long as its command runs, so they load as little as a Python process can.

This file is run as a script by a fresh interpreter, ``python -I -S .../inside.py FD IPTABLES IP6TABLES``, with
the environment ``PATH`` and ``LANG`` only: no ``site`` (a virtual environment's ``.pth`` hooks), no tether package,
and only C modules of the standard library and ``ctypes`` (``os``, ``_socket``, ``_signal``, ``select``,
``marshal``): about 3.3 MiB of its own where importing ``tether.proxy.rootless`` (dataclasses, pathlib, json,
subprocess) made 9 MiB, and PID 1 of the namespace is a fork of it (bench/RESULTS.md, "Density"). It holds no
secret and nothing of the ``tether run`` that started it: a fresh interpreter, not a fork of a process that read
keys or the caller's environment.

The channel to the outside is a socket pair between two tether processes only (the command never holds it: PID 1
closes it before the command is forked), so its messages are ``marshal``'s encoding of plain values (dicts,
lists, strings, booleans), framed by a 4-byte length; the listener and the resolver go out with the first one
(SCM_RIGHTS). The outside sends the plan (``Plan.to_wire()``), the inside says what it did.
"""

from __future__ import annotations

import _signal
import _socket
import ctypes
import marshal
import os
import select
import sys
import time

TYPE_CHECKING = False  # typing itself is not loaded: it is most of a megabyte
if TYPE_CHECKING:
    from typing import Any

LISTEN_PORT = 15001  # inside the namespace: every TCP connection is redirected here (rootless.LISTEN_PORT)
MAX_MESSAGE = 16 << 20  # a plan: a command line, an environment, the mounts
COMMAND_TIMEOUT_S = 20.0  # one network set-up command (ip, iptables)

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_RDONLY = 2, 4, 8, 1
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
FORWARDED = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1, _signal.SIGUSR2)
SI_KERNEL = 0x80  # a signal the terminal sent: the whole foreground group, the command included, has it already

_libc = ctypes.CDLL(None, use_errno=True)


# -- the channel -------------------------------------------------------------------------------------------------
def send_values(chan: Any, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    """One message: ``doc`` (plain values) in marshal's format, after its length; ``fds`` with the length."""
    data = marshal.dumps(doc)
    head = len(data).to_bytes(4, "big")
    if fds:
        rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
        chan.sendmsg([head], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        chan.sendall(data)
    else:
        chan.sendall(head + data)


def receive_values(chan: Any) -> tuple[dict[str, Any], list[int]]:
    """The next message and the descriptors that came with it; EOFError when the other side closed."""
    head, ancillary, _flags, _addr = chan.recvmsg(4, _socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    head += read_exactly(chan, 4 - len(head))
    size = int.from_bytes(head, "big")
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    doc = marshal.loads(read_exactly(chan, size))
    if not isinstance(doc, dict):
        raise ValueError("the enclosure's channel carries dicts only")
    return doc, fds


def read_exactly(chan: Any, size: int) -> bytes:
    """``size`` bytes from ``chan`` (fewer only when the other side closed: EOFError)."""
    data = b""
    while len(data) < size:
        more = chan.recv(size - len(data))
        if not more:
            raise EOFError("the other side of the enclosure closed")
        data += more
    return data


def _tell(chan: Any, doc: dict[str, Any], fds: list[int] | None = None) -> bool:
    """Send to the outside; False, quietly, when it is gone (a ``tether run`` interrupted while the enclosure
    was being made: this process follows it, by PDEATHSIG, with nothing to report)."""
    try:
        send_values(chan, doc, fds=fds)
    except (BrokenPipeError, ConnectionError):
        return False
    return True


# -- system calls ------------------------------------------------------------------------------------------------
def _c(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(_c(source), _c(target), _c(fstype), ctypes.c_ulong(flags), _c(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _prctl(option: int, value: int) -> None:
    _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _map_self(inside_uid: int, outside_uid: int, inside_gid: int, outside_gid: int) -> None:
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{inside_uid} {outside_uid} 1")
    _write("/proc/self/gid_map", f"{inside_gid} {outside_gid} 1")


def run_command(cmd: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str]:
    """Run ``cmd`` (looked up on PATH) with its output captured: its status and what it printed. One past
    ``timeout_s`` is killed (status -9). What ``subprocess.run`` does, without loading it."""
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawnp(cmd[0], cmd, os.environ, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, write_end, 1),
            (os.POSIX_SPAWN_DUP2, write_end, 2), (os.POSIX_SPAWN_CLOSE, read_end)])
    finally:
        os.close(write_end)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                continue
            piece = os.read(read_end, 65536)
            if not piece:
                break
            out += piece
        else:
            os.kill(pid, 9)
            out += f"\n(killed after {timeout_s:.0f}s)".encode()
    finally:
        os.close(read_end)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return status, out.decode(errors="replace")


def network_commands(iptables: str, ip6tables: str | None) -> list[list[str]]:
    """The namespace's network: loopback up, every address local, TCP to the listener, DNS to the resolver."""
    commands = [["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "local", "default", "dev", "lo"],
                [iptables, "-w", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-j", "REDIRECT", "--to-ports",
                 str(LISTEN_PORT)],
                [iptables, "-w", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "53", "-j", "REDIRECT",
                 "--to-ports", "53"]]
    if ip6tables:
        commands += [["ip", "-6", "route", "add", "local", "default", "dev", "lo"],
                     [ip6tables, "-w", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-j", "REDIRECT", "--to-ports",
                      str(LISTEN_PORT)]]
    return commands


def _network(iptables: str, ip6tables: str | None) -> bool:
    """Set the namespace's network up; whether IPv6 is there (a kernel without it has none to guard)."""
    ipv6 = os.path.exists("/proc/net/if_inet6")
    for cmd in network_commands(iptables, ip6tables if ipv6 else None):
        status, out = run_command(cmd)
        if status != 0:
            raise OSError(f"{' '.join(cmd)}: {out.strip()}")
    return ipv6


def _sockets(ipv6: bool) -> tuple[Any, Any]:
    if ipv6:
        tcp = _socket.socket(_socket.AF_INET6, _socket.SOCK_STREAM)
        tcp.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 0)
        tcp.bind(("::", LISTEN_PORT))
    else:
        tcp = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        tcp.bind(("0.0.0.0", LISTEN_PORT))
    tcp.listen(1024)
    udp = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 53))
    return tcp, udp


def _apply(mounts: list[dict[str, Any]]) -> None:
    for m in mounts:
        target = m["target"]
        if m["source"]:
            _mount(m["source"], target, None, MS_BIND | (MS_REC if m["directory"] else 0))
        else:
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0500")
        try:  # read-only is a courtesy: a flag the host's mount locks keeps it writable
            kept = os.statvfs(target).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
        except OSError:
            pass


# -- processes ---------------------------------------------------------------------------------------------------
def _supervise(child: int) -> int:
    """Wait for ``child``, passing on every signal sent to us (not those the terminal sent to everyone) and reaping
    every other process that ends (PID 1 inherits orphans); the child's status, a death by signal N as 128+N."""
    watched = {*FORWARDED, _signal.SIGCHLD}
    while True:
        try:
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == child:
                    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        except ChildProcessError:
            pass
        info = _signal.sigwaitinfo(watched)
        if info.si_signo != _signal.SIGCHLD and info.si_code != SI_KERNEL:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass


def _fork(body: Any) -> int:
    """Fork with the supervised signals held: none is lost before the parent waits for them; the child gets its
    mask back."""
    pid = os.fork()
    if pid == 0:
        try:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, set())
            os._exit(body())
        except BaseException:
            os._exit(126)
    return pid


def _command(plan: dict[str, Any], uid: int, gid: int) -> int:
    """In the command's process: one user namespace deeper, as the invoking user, with no capability."""
    command = plan["command"]
    try:
        _prctl(PR_SET_DUMPABLE, 1)  # to write our own maps (the exec that follows makes it so anyway)
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNS)
        _map_self(uid, 0, gid, 0)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.chdir(plan["cwd"])
        os.execvpe(command[0], command, plan["env"])
    except FileNotFoundError:
        print(f"tether: {command[0]}: command not found", file=sys.stderr, flush=True)
        return 127
    except OSError as exc:
        print(f"tether: cannot run {command[0]}: {exc}", file=sys.stderr, flush=True)
    return 126


def _init(plan: dict[str, Any], uid: int, gid: int) -> int:
    """PID 1 of the namespace: a fresh /proc, then the command, supervised."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {*FORWARDED, _signal.SIGCHLD})
    _prctl(PR_SET_DUMPABLE, 0)
    try:  # where the host's /proc is partly covered, the kernel refuses a new one
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    return _supervise(_fork(lambda: _command(plan, uid, gid)))


def main(argv: list[str]) -> int:
    """The inside: enter the namespaces, set the network up, hand over the sockets, mount, run the command."""
    chan = _socket.socket(fileno=int(argv[0]))
    iptables, ip6tables = argv[1], argv[2] or None
    uid, gid = os.getuid(), os.getgid()
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {*FORWARDED, _signal.SIGCHLD})
    _prctl(PR_SET_PDEATHSIG, _signal.SIGKILL)  # tether run gone (even SIGKILLed): so is the enclosure
    try:
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET | os.CLONE_NEWNS)
        _map_self(0, uid, 0, gid)
        _prctl(PR_SET_DUMPABLE, 0)  # after the maps: /proc/self of an undumpable process is not ours to write
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        ipv6 = _network(iptables, ip6tables)
        tcp, udp = _sockets(ipv6)
    except Exception as exc:  # the outside turns it into tether.isolation_unavailable
        _tell(chan, {"error": str(exc)})
        return 1
    told = _tell(chan, {"ipv6": ipv6}, fds=[tcp.fileno(), udp.fileno()])
    tcp.close()
    udp.close()
    if not told:
        return 1
    try:
        plan, _ = receive_values(chan)
    except (OSError, EOFError, ValueError):
        return 1
    try:
        _apply(plan["mounts"])
        os.unshare(os.CLONE_NEWPID)  # only now: the next fork is the namespace's PID 1
    except OSError as exc:
        _tell(chan, {"error": str(exc)})
        return 1

    def init() -> int:
        _prctl(PR_SET_PDEATHSIG, _signal.SIGKILL)
        chan.close()
        return _init(plan, uid, gid)

    child = _fork(init)
    _tell(chan, {"started": True})
    return _supervise(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
