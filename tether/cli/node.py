"""``tether node serve``: one pre-loaded parent from which a node's agents are forked.

Every ``tether run`` loads the same code (mitmproxy, aiohttp, cryptography, tether's sidecar): tens of MiB of
Python objects per agent. The node server loads it once, freezes it out of the collector's reach, and listens on
a Unix socket. ``tether run --node SOCKET`` (or ``TETHER_NODE=SOCKET``) sends it its command line, environment,
working directory and standard streams; the server forks, and the child is that agent's ``tether run``: its own
process and session, its own chain, key, state dir, sidecar and enclosure. The pages the child never writes stay
shared with the parent copy-on-write. A child that crashes takes no other agent with it, and the server's end
takes none of them either (they run on; only new runs need it).

The caller does not stay a Python process: once the child has accepted, ``tether run`` becomes a ``/bin/sh``
loop (``SHIM``) that holds the socket. It passes SIGTERM, SIGINT and SIGHUP on as lines, and exits with the status
the child writes (``exit N``) when its run ends, after the sidecar's stop and the report flush, as ``tether run``
always does. The child reads the socket's end (the caller gone, even by SIGKILL) as SIGTERM.

Only processes of the server's own user are served (``SO_PEERCRED``): a run is started with exactly the authority
its caller already had. The socket is covered inside every enclosure, as the state root is: an enforced command
cannot ask the node for an unenforced run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

SOCKET_VARIABLE = "TETHER_NODE"
NODE_UNAVAILABLE = "tether.node_unavailable"
LOST_MESSAGE = "the agent's process on the node ended without an exit status (its sidecar.log may say why)"
# The caller once the child accepted: the socket is descriptor 3. A trapped signal interrupts read; the flag tells
# that from the socket's end.
SHIM = r"""trap 'sig=1; echo TERM >&3' TERM
trap 'sig=1; echo INT >&3' INT
trap 'sig=1; echo HUP >&3' HUP
while :; do
  sig= line=
  IFS= read -r line <&3
  case $line in "exit "*) exit "${line#exit }";; esac
  [ -n "$sig" ] || { echo "error: tether.sidecar_failed: $LOST" >&2; exit 2; }
done"""
RELAYED = {"TERM": signal.SIGTERM, "INT": signal.SIGINT, "HUP": signal.SIGTERM}  # a hang-up ends the run cleanly
# Loaded before the first fork: what every agent's run, sidecar and enclosure imports, so no child imports it.
PRELOAD = ("tether.cli.main", "tether.cli.run", "tether.cli.sidecar", "tether.cli.delegation", "tether.proxy.sidecar",
           "tether.proxy.rootless", "tether.proxy.isolate", "tether.proxy.secrets", "tether.proxy.credentials",
           "tether.proxy.stdio", "tether.proxy.transparent", "mitmproxy.certs", "mitmproxy.proxy.server",
           "mitmproxy.proxy.layers", "mitmproxy.net.tls", "aiohttp", "asyncio", "ssl", "concurrent.futures.thread",
           "queue", "encodings.idna")

_served_by: list[str] = []  # in a forked child: the server's socket (set once, right after the fork)


def served_by() -> str | None:
    """The node server's socket, in a run it forked; None elsewhere."""
    return _served_by[0] if _served_by else None


def default_socket() -> Path:
    """Under the state root, which every enclosure covers."""
    from .sidecar import default_state_root

    return default_state_root() / "node.sock"


def add_node(sub: Any) -> None:
    p = sub.add_parser("node", help="serve a node's agents from one pre-loaded process (tether node serve)")
    node_sub = p.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    s = node_sub.add_parser("serve", help="fork each tether run --node from one pre-loaded parent (until SIGTERM)")
    s.add_argument("--socket", metavar="PATH", default=None,
                   help="the Unix socket to listen on (default: $XDG_STATE_HOME/tether/node.sock, else "
                        "~/.local/state/tether/node.sock)")
    s.set_defaults(func=cmd_node_serve)


# -- the caller ----------------------------------------------------------------------------------------------------
def run_on_node(path: str, argv: list[str]) -> int:
    """Hand this ``tether run`` (``argv``, environment, working directory, standard streams) to the node server,
    then become ``SHIM``; returns only when the server refused."""
    from tether.proxy.rootless import receive, send

    from .run import without_authority

    chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        chan.connect(path)
        send(chan, {"argv": argv, "cwd": os.getcwd(), "env": without_authority(os.environ)}, fds=[0, 1, 2])
        doc, _ = receive(chan)
    except (OSError, EOFError) as exc:
        raise TetherError(f"no node server answers at {path} ({exc}): start one with tether node serve, or run "
                          f"without --node (and {SOCKET_VARIABLE})", code=NODE_UNAVAILABLE) from None
    if "error" in doc:
        raise TetherError(f"the node server at {path} refused the run: {doc['error']}", code=NODE_UNAVAILABLE)
    sys.stdout.flush()
    sys.stderr.flush()
    if chan.fileno() != 3:
        os.dup2(chan.fileno(), 3)
    os.set_inheritable(3, True)  # the shim's (dup2 onto itself would keep close-on-exec)
    os.execve("/bin/sh", ["tether-run", "-c", 'eval "$SHIM"'], {"SHIM": SHIM, "LOST": LOST_MESSAGE})
    raise AssertionError("unreachable")  # pragma: no cover


# -- the server ----------------------------------------------------------------------------------------------------
class _Stopped(Exception):
    pass


def cmd_node_serve(args: argparse.Namespace) -> int:
    from .run import drop_authority

    drop_authority()  # every fork's /proc/PID/environ is the server's as it started: no tether token in it
    path = Path(args.socket) if args.socket else default_socket()
    listener = _listen(path)
    _one_malloc_arena()
    preload()
    import gc

    gc.freeze()  # what every child shares: out of the collector's reach, so no collection writes to its pages

    def stop(_sig: int, _frame: Any) -> None:
        raise _Stopped

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGCHLD, _reap)
    print(f"tether: node server on {path} (pid {os.getpid()}): tether run --node {path} ... (or "
          f"{SOCKET_VARIABLE}={path})", file=sys.stderr, flush=True)
    try:
        while True:
            conn, _ = listener.accept()
            if _peer_uid(conn) != os.getuid():
                with contextlib.suppress(OSError):
                    _refuse(conn, "only the node server's own user is served")
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                os._exit(_child(conn, str(path)))
            conn.close()
    except _Stopped:
        return 0
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            path.unlink()


M_ARENA_MAX = -8  # glibc's mallopt parameter


def _one_malloc_arena() -> None:
    """glibc gives each thread that allocates an arena of its own, whose touched pages are private to that agent's
    fork: a sidecar's few threads (capture maintenance, the event loop's executor, delegation) share the main arena
    instead. Set before anything is loaded, for the server and every fork. Elsewhere than glibc: nothing."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from .main import build_parser

    build_parser()


def _listen(path: Path) -> socket.socket:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a server that is gone left it
        else:
            raise TetherError(f"a node server already listens on {path}", code=BAD_REQUEST)
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(128)
    return listener


def _peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def _refuse(conn: socket.socket, why: str) -> None:
    from tether.proxy.rootless import send

    send(conn, {"error": why})


def _reap(_sig: int, _frame: Any) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def _child(conn: socket.socket, path: str) -> int:
    """In the fork: take the caller's streams, directory and environment, run its ``tether run``, write the
    status. Its own session: a signal to the server's group reaches no agent."""
    for sig in (signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _terminated)  # until the run's own handling: end it, still writing a status
    os.setsid()
    _served_by.append(path)
    try:
        from tether.proxy.rootless import receive, send

        from .run import without_authority

        doc, fds = receive(conn)
        if len(fds) != 3 or not isinstance(doc.get("argv"), list):
            _refuse(conn, "a request names the command line and passes three streams")
            return 2
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(str(doc.get("cwd") or "/"))
        env = {str(k): str(v) for k, v in dict(doc.get("env") or {}).items() if k != SOCKET_VARIABLE}
        os.environ.clear()
        os.environ.update(without_authority(env))
        send(conn, {"accepted": os.getpid()})
    except (OSError, EOFError, ValueError) as exc:
        with contextlib.suppress(OSError):
            _refuse(conn, str(exc))
        return 2
    threading.Thread(target=_relay, args=(conn,), name="tether-node-relay", daemon=True).start()
    from .main import main

    try:
        code = main([str(a) for a in doc["argv"]])
    except SystemExit as exc:  # a usage error (argparse), or SIGTERM before the run handles it
        code = exc.code if isinstance(exc.code, int) else 2
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        conn.sendall(f"exit {code}\n".encode())
    return code


def _terminated(_sig: int, _frame: Any) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def _relay(conn: socket.socket) -> None:
    """The caller's signals, as lines; its end (the shim gone, even killed) is SIGTERM: the run stops."""
    buffer = b""
    while True:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if not data:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            sig = RELAYED.get(line.decode(errors="replace").strip())
            if sig is not None:
                os.kill(os.getpid(), sig)
