"""Sub-agents of an enforced command: delegation through the ``tether run`` that encloses it.

An enforced command holds no key (that is the point), yet agents spawn agents. Its ``tether run`` serves a Unix
socket inside the enclosure (``TETHER_DELEGATE``); a ``tether run --parent-chain "$TETHER_CHAIN" --agent A --cap
...`` started by the command finds it and, instead of starting anything itself, sends its request there with its
standard streams. The outer ``tether run`` (outside the enclosure, holding the key) starts the child as a
``tether run`` of its own: a child link minted under the command's chain, its own sidecar, its own enclosure. The
stub relays signals one way and the exit status the other, so to the command it is an ordinary child process;
when the stub goes, so does the child.

A delegated child may only narrow: the chain rules refuse a wider grant, and the request may name only the
options below (``ALLOWED``), never a chain, key, state dir, secret, capture setting or an unenforced mode. A
child of an enforced command is enforced.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

DELEGATE_VARIABLE = "TETHER_DELEGATE"
# The child options a stub may pass on (dest -> flag): what narrows or tunes the child, nothing that widens it.
ALLOWED = {"agent": "--agent", "cap": "--cap", "ttl": "--ttl", "approval_timeout": "--approval-timeout",
           "call_timeout": "--call-timeout", "stop_window": "--stop-window", "redact_field": "--redact-field"}
REFUSED = ("chain", "key", "parent_key", "state_dir", "secret", "catalog", "trust", "upstream_ca", "capture_file",
           "no_capture", "allow_uncaptured", "cooperative", "user", "listen", "transparent_listen", "dns_listen",
           "ready_file", "no_default_redact_fields", "capture_max_bytes", "capture_keep", "capture_node_max_bytes",
           "capture_min_free", "capture_segment_bytes", "capture_segment_age", "capture_hold", "no_capture_compress")


def requested(args: Any, defaults: Any) -> dict[str, Any]:
    """The child options a stub sends; refuses (``tether.bad_request``) one a delegated child may not set (any
    option in ``REFUSED`` whose value differs from its default)."""
    given = [name for name in REFUSED if getattr(args, name, None) != getattr(defaults, name, None)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise TetherError(f"a sub-agent of an enforced command is delegated through its tether run, which does not "
                          f"take {flags}: give --parent-chain \"$TETHER_CHAIN\", --agent and --cap", code=BAD_REQUEST)
    return {name: getattr(args, name) for name in ALLOWED if getattr(args, name, None) is not None}


def child_argv(options: dict[str, Any], *, controlplane: str, parent_chain: str, parent_key: str,
               state_root: str) -> list[str]:
    """The outer side's ``tether run`` for a request: the parent's own chain and key, the request's options.
    Isolated (``-I``): nothing of the requester's environment or working directory reaches this interpreter."""
    argv = [sys.executable, "-I", "-m", "tether", "run", "--controlplane", controlplane, "--parent-chain",
            parent_chain, "--parent-key", parent_key, "--state-dir", state_root]
    for name, value in options.items():
        if name not in ALLOWED:
            raise TetherError(f"a delegated child may not set {name}", code=BAD_REQUEST)
        for one in value if isinstance(value, list) else [value]:
            if not isinstance(one, str | int | float) or isinstance(one, bool):
                raise TetherError(f"a delegated child's {name} must be text or a number", code=BAD_REQUEST)
            argv.append(f"{ALLOWED[name]}={one}")  # one token: a value never reads as another option
    return argv


# -- inside: the stub ----------------------------------------------------------------------------------------------
def run_stub(path: str, options: dict[str, Any], command: list[str]) -> int:
    """Ask the enclosing ``tether run`` to start this child; relay signals to it and return its exit status."""
    from tether.proxy.rootless import receive, send

    chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        chan.connect(path)
    except OSError as exc:
        raise TetherError(f"cannot reach the enclosing tether run at {path} ({exc.strerror}): a sub-agent of an "
                          "enforced command is started through it", code="tether.sidecar_failed") from None
    env = {k: v for k, v in os.environ.items() if k != DELEGATE_VARIABLE}
    send(chan, {"options": options, "command": command, "cwd": os.getcwd(), "env": env}, fds=[0, 1, 2])
    previous = {sig: signal.signal(sig, lambda s, _f: send(chan, {"signal": s})) for sig in (signal.SIGTERM,
                                                                                          signal.SIGINT)}
    try:
        while True:
            try:
                doc, _ = receive(chan)
            except EOFError:
                raise TetherError("the enclosing tether run went away", code="tether.sidecar_failed") from None
            except InterruptedError:
                continue
            if "exit" in doc:
                return int(doc["exit"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        chan.close()


# -- outside: the server -------------------------------------------------------------------------------------------
class DelegationServer:
    """Serves ``TETHER_DELEGATE`` for one enforced command: each request becomes a child ``tether run``."""

    def __init__(self, path: Path, *, controlplane: str, parent_chain: str, parent_key: str, state_root: str) -> None:
        self.path = path
        self.spec = {"controlplane": controlplane, "parent_chain": parent_chain, "parent_key": parent_key,
                     "state_root": state_root}
        self.private = Path(state_root) / ".delegation"  # under the state root: covered from the command
        self.private.mkdir(mode=0o700, exist_ok=True)
        self.children: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, name="tether-delegate", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from tether.proxy.rootless import receive, send

        from .run import without_authority

        child: subprocess.Popen | None = None
        fds: list[int] = []
        try:
            doc, fds = receive(conn)
            if len(fds) != 3 or not doc.get("command"):
                send(conn, {"exit": 2})
                return
            # The requester's environment and directory are its command's only: the child tether run runs outside
            # the enclosure, so it gets this process's environment (an LD_PRELOAD or PYTHONPATH of the
            # requester's would run its code out here) and this directory.
            wanted = {str(k): str(v) for k, v in dict(doc.get("env", {})).items()
                      if k not in ("TETHER_ADMIN_TOKEN", "TETHER_TOKEN", "TETHER_KEY")}
            env_file = self.private / f"env-{os.urandom(8).hex()}.json"
            env_file.write_text(json.dumps(wanted))
            os.chmod(env_file, 0o600)
            argv = [*child_argv(doc.get("options", {}), **self.spec), "--command-env", str(env_file),
                    "--command-cwd", str(doc.get("cwd") or "/"), "--", *doc["command"]]
            with self._lock:
                if self._closed:
                    send(conn, {"exit": 143})
                    return
                child = subprocess.Popen(argv, stdin=fds[0], stdout=fds[1], stderr=fds[2],
                                         env=without_authority(os.environ), start_new_session=True)
                self.children.append(child)
            for fd in fds:
                os.close(fd)
            fds = []
            threading.Thread(target=self._signals, args=(conn, child), daemon=True).start()
            code = child.wait()
            send(conn, {"exit": 128 - code if code < 0 else code})
        except (OSError, EOFError, ValueError, TetherError):
            if child is not None and child.poll() is None:
                child.terminate()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            conn.close()

    @staticmethod
    def _signals(conn: socket.socket, child: subprocess.Popen) -> None:
        """Signals the stub relays; the stub gone (its socket closed) ends the child."""
        from tether.proxy.rootless import receive

        while child.poll() is None:
            try:
                doc, _ = receive(conn)
            except (OSError, EOFError, ValueError):  # gone, or not speaking the protocol: it ends
                if child.poll() is None:
                    child.terminate()
                return
            if isinstance(doc.get("signal"), int) and doc["signal"] in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(doc["signal"])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting; end every child still running (each stops its own sidecar)."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        with contextlib.suppress(OSError):
            self.path.unlink()
