"""``tether run``: put an unmodified command under a sidecar.

It starts ``tether sidecar`` as a separate process, waits until the proxy listens, then runs the command
enforced (the default): in an enclosure whose only way out is the sidecar (tether/proxy/rootless.py, no root
needed), or, with ``--user`` as root, in a veth namespace as that user (tether/proxy/isolate.py). ``--cooperative``
instead runs it with ``HTTP_PROXY``/``HTTPS_PROXY`` and the CA variables set (``NO_PROXY`` emptied), which
only governs programs that follow them. With ``--parent-chain/--parent-key`` it first delegates a narrower
chain to a fresh key for the child. When the command exits, the sidecar is stopped cleanly; the command's exit
code is returned. Every sidecar option is accepted here and forwarded to the sidecar as given (``SIDECAR_OPTIONS``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .delegation import DELEGATE_VARIABLE
from .grant import CAP_METAVAR
from .node import SOCKET_VARIABLE, served_by
from .remote import DEFAULT_CONTROLPLANE, add_controlplane
from .sidecar import RETIRED, SIDECAR_OPTIONS, default_state_root

CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE")
# tether's own authority: an agent holding one could approve its own held calls or revoke and terminate others.
# Neither the command nor its sidecar (whose /proc environ the command's user may read) keeps them.
AUTHORITY_VARIABLES = ("TETHER_ADMIN_TOKEN", "TETHER_TOKEN")
COOPERATIVE_WARNING = ("tether: cooperative mode: only programs that follow HTTP(S)_PROXY are governed; a client that "
                       "ignores the proxy variables (Node's fetch, aiohttp's default session, websockets, stdio MCP "
                       "servers started with a reset environment) goes around the sidecar unseen. Without "
                       "--cooperative, tether run enforces every client.")
# The sidecar options whose meaning differs under run: run decides the chain, key and state dir it hands on.
RUN_OVERRIDES: dict[str, dict[str, Any]] = {
    "chain": {"required": False, "help": "the agent's chain file (or --parent-chain and friends)"},
    "key": {"required": False, "help": "the private key of the chain's leaf"},
    "listen": {"default": "127.0.0.1:0", "help": "where the sidecar's proxy listens (default: a free port)"},
    "state_dir": {"help": "the root of the state dirs: the agent's is STATE_DIR/AGENT (default: $XDG_STATE_HOME/"
                          "tether, else ~/.local/state/tether)"},
    "secret": {"help": "a catalog credential's secret, given to the sidecar only; env:VAR is removed from the "
                       "command's environment (repeat)"},
}
SET_BY_RUN = ("chain", "key", "state_dir", "ready_file")  # forwarded as run resolved them, not as given


def add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run a command under a sidecar (every sidecar option is forwarded to it)")
    add_controlplane(p)
    for option in SIDECAR_OPTIONS:
        option.add_to(p, **RUN_OVERRIDES.get(option.dest, {}))
    p.add_argument("--parent-chain", metavar="F", help="delegate the command a child link under this chain")
    p.add_argument("--parent-key", metavar="F", help="the private key of --parent-chain's leaf")
    p.add_argument("--agent", help="the child's agent id (with --parent-chain; default PARENT.RANDOM)")
    p.add_argument("--cap", action="append", metavar=CAP_METAVAR,
                   help="the child's capability and tier (with --parent-chain; repeat)")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="S", help="seconds the child link lives")
    p.add_argument("--isolate", action="store_true", help="enforce (the default, kept as a synonym): the command's "
                   "only way out is its sidecar, whatever client it uses")
    p.add_argument("--cooperative", action="store_true", help="do not enforce: only set the proxy variables, so "
                   "programs that ignore HTTP(S)_PROXY are not governed (says so on every start)")
    p.add_argument("--user", default=None, help="Linux, root: enforce by a veth namespace and host rules instead, "
                   "running the command as this unprivileged user (e.g. nobody)")
    # Set by the tether run that delegates for an enforced command (tether/cli/delegation.py): the sub-agent's own
    # environment and working directory are its command's, never this process's.
    p.add_argument("--node", metavar="SOCKET", default=os.environ.get(SOCKET_VARIABLE),
                   help="run as a fork of the node server listening on SOCKET (tether node serve), sharing its loaded "
                        f"code (default: ${SOCKET_VARIABLE}, else a process of its own)")
    p.add_argument("--command-env", metavar="F", help=argparse.SUPPRESS)
    p.add_argument("--command-cwd", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command and its arguments")
    p.set_defaults(func=cmd_run)


def sidecar_namespace(args: argparse.Namespace, *, chain: str, key: str, state_dir: Path, ready: Path,
                      fds: tuple[int, int] | None = None) -> argparse.Namespace:
    """What the sidecar this run serves reads (``config_from_args``): every sidecar option as given to run, the
    ones in ``SET_BY_RUN`` as run resolved them, and the enclosure's sockets."""
    resolved = {"chain": chain, "key": key, "state_dir": str(state_dir), "ready_file": str(ready)}
    values = {o.dest: resolved[o.dest] if o.dest in SET_BY_RUN else getattr(args, o.dest) for o in SIDECAR_OPTIONS}
    return argparse.Namespace(controlplane=args.controlplane or DEFAULT_CONTROLPLANE, enclosure_fds=fds, **values)


def _delegate(args: argparse.Namespace, state_root: Path) -> tuple[str, str, str]:
    """Mint a child link for the command; returns (chain path, key path, agent)."""
    from tether.capability import keys
    from tether.capability.chain import mint_child, parse_chain_unverified
    from tether.capability.shared import parse_caps, read_chain, read_file, write_secret

    parent_wire = read_chain(args.parent_chain)
    parent = parse_chain_unverified(parent_wire)[-1]
    parent_key = keys.load_private(read_file(args.parent_key, "parent key"), args.parent_key)
    agent = args.agent or f"{parent.sub}.{uuid.uuid4().hex[:6]}"
    if agent in (".", ".."):  # a valid id, but its state dir would be the state root or the directory above it
        raise TetherError(f"--agent {agent}: not an agent id tether run can keep a state dir for", code=BAD_REQUEST)
    child_key = keys.generate()
    child = mint_child(parent, parent_key, agent=agent, subject_key=child_key.public_key(),
                       caps=parse_caps(args.cap), now=time.time(), ttl_s=args.ttl)
    directory = state_root / agent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    chain_path, key_path = directory / "chain", directory / "key"
    chain_path.write_text(f"{parent_wire},{child}\n")
    key_path.unlink(missing_ok=True)  # this run's own key: the last run's, with its chain, is replaced whole
    write_secret(str(key_path), keys.private_pem(child_key))
    return str(chain_path), str(key_path), agent


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise TetherError("give the command after --, e.g. tether run --chain c --key k -- python agent.py",
                          code=BAD_REQUEST)
    delegate = os.environ.get(DELEGATE_VARIABLE)
    if delegate and args.parent_chain and not args.parent_key:  # a sub-agent of an enforced command
        from .delegation import requested, run_stub
        from .main import build_parser

        return run_stub(delegate, requested(args, build_parser().parse_args(["run", "--", "true"])), command)
    if args.cooperative and (args.isolate or args.user):
        raise TetherError("--cooperative contradicts --isolate and --user (which enforce): give one",
                          code=BAD_REQUEST)
    if (args.user or not args.cooperative) and (args.transparent_listen or args.dns_listen):
        raise TetherError("an enforced run chooses the transparent and DNS listeners itself: drop "
                          "--transparent-listen and --dns-listen (or give --cooperative)", code=BAD_REQUEST)
    base = _base_env(args.command_env)
    cwd = args.command_cwd or os.getcwd()
    try:
        check_command(command[0], base.get("PATH", os.defpath), cwd)
    except CommandNotFound as exc:  # a shell's status for it, with tether's line
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return COMMAND_NOT_FOUND_STATUS
    node_socket = served_by()
    if args.node and node_socket is None and args.command_env is None:  # (a delegated sub-agent runs here)
        from .node import run_on_node

        return run_on_node(args.node, sys.argv[1:])
    drop_authority()  # before anything is started: the sidecar is this process
    unreachable = _unreachable(args.controlplane or DEFAULT_CONTROLPLANE)
    if unreachable:  # said now, not once the sidecar's code is loaded; the sidecar keeps trying and saying so
        print(f"tether: waiting for the control plane at {args.controlplane or DEFAULT_CONTROLPLANE}: {unreachable}, "
              "still trying (Ctrl-C to give up)", file=sys.stderr, flush=True)
    from tether.proxy.secrets import SecretSpec

    secrets = [SecretSpec.parse(text) for text in args.secret or []]  # before anything is written
    state_root = Path(args.state_dir) if args.state_dir else default_state_root()
    chain_path, key_path, agent = _identity(args, state_root)
    state_dir = state_root / agent
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = "cooperative" if args.cooperative else "as-user" if args.user else "enforced"
    run = Run(args, agent=agent, waiting_said=bool(unreachable), command=command, cwd=cwd, base=base,
              secrets=secrets, state_root=state_root, chain_path=chain_path, key_path=key_path,
              covered=[Path(p) for p in (node_socket, args.node) if p])
    try:
        if mode == "as-user":
            from tether.proxy.isolate import DNS_PORT, TRANSPARENT_PORT, Isolation

            os.chmod(state_dir, 0o700)  # the CA key, spool and captures: the sidecar's, not the command's
            run.isolation = Isolation.create(args.user)
            host = run.isolation.plan.host_ip
            run.args = argparse.Namespace(**{**vars(args), "transparent_listen": f"{host}:{TRANSPARENT_PORT}",
                                             "dns_listen": f"{host}:{DNS_PORT}"})
            run.isolation.check_unreadable([Path(key_path), *(Path(s.ref) for s in secrets if s.kind == "file")])
        elif mode == "enforced":
            from tether.proxy.rootless import Enclosure

            run.enclosure = Enclosure.open()  # before the sidecar: it serves the sockets the enclosure makes
        return run.serve()
    finally:
        run.close()


def _unreachable(url: str, timeout_s: float = 1.0) -> str | None:
    """Whether the control plane's port takes a connection: why not, or None (the sidecar finds out the rest)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return f"unreachable ({getattr(exc, 'strerror', None) or exc})"


class CommandNotFound(TetherError):
    code = "tether.command_not_found"


COMMAND_NOT_FOUND_STATUS = 127  # what a shell answers for a command it cannot find


def check_command(name: str, path: str, cwd: str) -> None:
    """Refuse, before any sidecar starts, a command that cannot be run: not on ``path`` (a bare name) or not an
    executable file (a path, relative to ``cwd``)."""
    if os.sep in name:
        found = os.path.join(cwd, name)
        if os.path.isfile(found) and os.access(found, os.X_OK):
            return
        why = "no such file" if not os.path.exists(found) else "not an executable file"
        raise CommandNotFound(f"{name}: {why} (tether run starts nothing for it)")
    if shutil.which(name, path=path) is None:
        raise CommandNotFound(f"{name}: command not found on PATH (tether run starts nothing for it)")


def drop_authority() -> None:
    """This process is the sidecar, and its environment as it started stays readable in /proc/PID/environ to
    processes of the same user (a cooperative command): with a tether token in it, start again without."""
    if not any(name in os.environ for name in AUTHORITY_VARIABLES):
        return
    flags = ["-I"] if sys.flags.isolated else []
    os.execve(sys.executable, [sys.executable, *flags, "-m", "tether", *sys.argv[1:]], without_authority(os.environ))


class Run:
    """One ``tether run``: the sidecar served in this process, the command supervised by it, then the stop."""

    def __init__(self, args: argparse.Namespace, *, agent: str, waiting_said: bool, command: list[str], cwd: str,
                 base: Mapping[str, str], secrets: list, state_root: Path, chain_path: str, key_path: str,
                 covered: list[Path]) -> None:
        self.args, self.agent, self.command, self.cwd, self.base = args, agent, command, cwd, base
        self.covered = covered  # besides the state root and the keys: the node server's socket
        self.secrets, self.state_root, self.chain_path, self.key_path = secrets, state_root, chain_path, key_path
        self.state_dir = state_root / agent
        self.log_path = self.state_dir / "sidecar.log"
        self.isolation: Any = None
        self.enclosure: Any = None
        self.delegation: Any = None
        self.child: subprocess.Popen | None = None
        self._log: Any = None
        self._waiting_said = waiting_said  # run said so already: the sidecar's first such line goes to the log only

    def sidecar_args(self) -> argparse.Namespace:
        """What the sidecar reads: every sidecar option as given to run, with the chain, key, state dir and ready
        file as run resolved them, and the enclosure's sockets."""
        return sidecar_namespace(self.args, chain=self.chain_path, key=self.key_path, state_dir=self.state_dir,
                                 ready=self.ready_path(),
                                 fds=(self.enclosure.listener, self.enclosure.resolver) if self.enclosure else None)

    def ready_path(self) -> Path:
        return Path(self.args.ready_file) if self.args.ready_file else self.state_dir / "sidecar.ready"

    def serve(self) -> int:
        import asyncio

        from .sidecar import config_from_args, serve_sidecar, setup_logging

        ready = self.ready_path()
        ready.unlink(missing_ok=True)
        self._log = open(self.log_path, "a", buffering=1)
        setup_logging(self._log)
        config = config_from_args(self.sidecar_args())

        async def main() -> int:
            loop = asyncio.get_running_loop()
            task = asyncio.current_task()
            assert task is not None
            loop.add_signal_handler(signal.SIGTERM, task.cancel)  # until the command runs: stop starting
            return await serve_sidecar(config, str(ready), serve=self.supervise, say=self.say)

        try:
            code = asyncio.run(main())
        except asyncio.CancelledError:  # SIGTERM before the command started
            return 128 + signal.SIGTERM
        if self.child is None and code == RETIRED:  # the sidecar may not serve: the command never started
            raise TetherError("the sidecar did not start: its chain may not serve (above; the log "
                              f"{self.log_path} has the rest)", code="tether.sidecar_failed")
        return code

    def say(self, text: str) -> None:
        """The sidecar's status lines: all in the log; on the terminal all but where it listens (run says how the
        command runs instead)."""
        print(f"tether: {text}", file=self._log, flush=True)
        if text.startswith("waiting for the control plane") and self._waiting_said:
            self._waiting_said = False
        elif not text.startswith("sidecar for "):
            print(f"tether: {text}", file=sys.stderr, flush=True)

    async def supervise(self, info: dict[str, Any]) -> int:
        """While the sidecar serves: start the command, pass it SIGTERM and SIGINT, wait for its end; its exit
        status, a death by signal N as 128+N (so Ctrl-C, which the command gets too, ends run with 130 as it does
        the command). Its sub-agents and its enclosure go before the sidecar stops."""
        import asyncio

        if self.enclosure is not None:
            self.enclosure.handed_over()  # the sidecar's alone now
        loop = asyncio.get_running_loop()
        child = await asyncio.to_thread(self.start_command, info)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda sig=sig: _signal(child, sig))
        code = await asyncio.to_thread(child.wait)
        await asyncio.to_thread(self.close_command)
        return 128 - code if code < 0 else code

    def start_command(self, info: dict[str, Any]) -> subprocess.Popen:
        args, agent, isolation, enclosure = self.args, self.agent, self.isolation, self.enclosure
        controlplane = args.controlplane or DEFAULT_CONTROLPLANE
        env = _command_env(info, self.secrets, isolation, enclosure, self.state_dir, self.base)
        env.update({"TETHER_AGENT": agent, "TETHER_CONTROLPLANE": controlplane})
        if enclosure is None:  # enclosed, the chain and state dir are covered: naming them would only mislead
            env.update({"TETHER_CHAIN": os.path.abspath(self.chain_path),
                        "TETHER_STATE_DIR": os.path.abspath(self.state_root)})
        if isolation is None and enclosure is None:  # an isolated command cannot read the key
            env["TETHER_KEY"] = os.path.abspath(self.key_path)
        if enclosure is not None:
            from .delegation import DelegationServer

            chain_copy = enclosure.workdir / "chain"  # the chain is no secret: the command may read and show it
            chain_copy.write_text(Path(self.chain_path).read_text())
            self.delegation = DelegationServer(enclosure.workdir / "delegate.sock", controlplane=controlplane,
                                               parent_chain=os.path.abspath(self.chain_path),
                                               parent_key=os.path.abspath(self.key_path),
                                               state_root=os.path.abspath(self.state_root))
            env.update({"TETHER_CHAIN": str(chain_copy), DELEGATE_VARIABLE: str(self.delegation.path)})
            print(f"tether: {agent} runs enforced: its only way out is its sidecar (log {self.log_path})",
                  file=sys.stderr, flush=True)
            covered = [self.state_root, Path(self.key_path), *([Path(args.parent_key)] if args.parent_key else []),
                       *self.covered]
            _enclose(enclosure, self.command, env, info, self.secrets, covered, self.cwd)
            self.child = enclosure.process
            return enclosure.process
        where = info["proxy"] if isolation is None else \
            f"{isolation.plan.host_ip}:{isolation.plan.tport} (isolated in {isolation.plan.netns} as " \
            f"{isolation.user.name})"
        print(f"tether: {agent} runs behind its sidecar at {where} (log {self.log_path})", file=sys.stderr,
              flush=True)
        if isolation is None:
            print(COOPERATIVE_WARNING, file=sys.stderr, flush=True)
        self.child = subprocess.Popen(isolation.wrap(self.command) if isolation is not None else self.command,
                                      env=env, cwd=self.cwd, preexec_fn=_die_with_parent(os.getpid()))
        return self.child

    def close_command(self) -> None:
        """The command's sub-agents (each stops its own sidecar), then the enclosure; idempotent."""
        if self.delegation is not None:
            self.delegation.close()
            self.delegation = None
        if self.enclosure is not None:
            if self.child is not None and self.enclosure.process.poll() is None:
                # The command first: its calls are the sidecar's to finish. (Before the command started, the
                # enclosure holds SIGTERM blocked for it: there is nothing to wait for, destroy kills it.)
                self.enclosure.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.enclosure.process.wait(timeout=5)
            self.enclosure.destroy()
            self.enclosure = None

    def close(self) -> None:
        """Whatever happened: no command, sub-agent, enclosure or namespace is left behind."""
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(timeout=5)
        self.close_command()
        if self.isolation is not None:
            self.isolation.destroy()
            self.isolation = None
        if self._log is not None:
            self._log.close()


def _die_with_parent(parent: int) -> Callable[[], None]:
    """In the command's child before exec: it is SIGKILLed if this process dies, even SIGKILLed itself (an
    enclosed command goes with its enclosure already), so no agent outlives its sidecar. The kernel sends it when
    the thread that started the command ends: asyncio's worker threads last until the run has ended."""

    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child imports nothing after the fork

    def arm() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # this process died between the fork and the prctl
            os._exit(137)

    return arm


def _signal(child: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(sig)


def _enclose(enclosure: Any, command: list[str], env: dict[str, str], info: dict, secrets: list,
             covered: list[Path], cwd: str) -> None:
    """Start the command in the enclosure: the system's trust stores with the sidecar's CA, the resolver, and
    covers over the state root, the keys and the secret files."""
    from tether.proxy.rootless import Plan, cover_mounts, node_mounts, resolver_mount, trust_mounts

    ca_pem = Path(info["ca"]).read_bytes()
    path_dirs = [d for d in env.get("PATH", "").split(os.pathsep) if d]
    mounts = [*trust_mounts(ca_pem, enclosure.workdir, path_dirs, Path(info["state_dir"])),
              *node_mounts(Path(env["NODE_EXTRA_CA_CERTS"]), enclosure.workdir, path_dirs),
              *resolver_mount(enclosure.workdir),
              *cover_mounts([*covered, *(Path(s.ref) for s in secrets if s.kind == "file")], enclosure.workdir)]
    enclosure.start(Plan(command, env, cwd, mounts))


def _identity(args: argparse.Namespace, state_root: Path) -> tuple[str, str, str]:
    """The chain and key the sidecar serves (given, or delegated for this command), and the agent's id."""
    if args.parent_chain:
        if not args.parent_key or not args.cap:
            raise TetherError("--parent-chain needs --parent-key and at least one --cap NAME=TIER", code=BAD_REQUEST)
        return _delegate(args, state_root)
    if args.chain and args.key:
        from tether.capability.chain import parse_chain_unverified
        from tether.capability.shared import read_chain

        return args.chain, args.key, parse_chain_unverified(read_chain(args.chain))[-1].sub
    raise TetherError("give --chain and --key, or --parent-chain, --parent-key and --cap", code=BAD_REQUEST)


def without_authority(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without tether's tokens (``AUTHORITY_VARIABLES``)."""
    return {k: v for k, v in environ.items() if k not in AUTHORITY_VARIABLES}


def _base_env(path: str | None) -> Mapping[str, str]:
    """The environment the command starts from: this process's, or (a delegated sub-agent) the one its parent
    asked for, read from the file the delegating run wrote and then removed."""
    if path is None:
        return os.environ
    try:
        doc = json.loads(Path(path).read_text())
    finally:
        Path(path).unlink(missing_ok=True)
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise TetherError(f"{path}: not an environment (a JSON object of strings)", code=BAD_REQUEST)
    return doc


def _command_env(info: dict, secrets: list, isolation: Any, enclosure: Any, state_dir: Path,
                 base: Mapping[str, str]) -> dict:
    """The command's environment: the proxy (or, enforced, none to follow), the CA, and no token or sidecar
    secret."""
    env = without_authority(base)
    for spec in secrets:  # the secret is the sidecar's alone: the command never sees the variable
        if spec.kind == "env":
            env.pop(spec.ref, None)
    env["NO_PROXY"] = env["no_proxy"] = ""
    proxies = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
    if isolation is None and enclosure is None:
        env.update(dict.fromkeys(proxies, info["proxy"]))
        env["NODE_USE_ENV_PROXY"] = "1"  # Node 22.21+ and 24: fetch follows the proxy variables (older Node ignores it)
        ca = os.path.abspath(info["ca"])
    else:
        # Every connection is intercepted where it goes: no proxy to follow (or to find out of reach).
        for name in proxies:
            env.pop(name, None)
    if enclosure is not None:
        from tether.proxy.rootless import bundle_path

        ca = str(bundle_path(enclosure.workdir, Path(info["ca"]).read_bytes()))
    elif isolation is not None:
        isolation.check_unreadable(sorted((state_dir / "ca").glob("mitmproxy-ca*.pem")))
        ca = str(isolation.trust(Path(info["ca"])))
        env.update({"HOME": str(isolation.workdir / "home"), "USER": isolation.user.name,
                    "LOGNAME": isolation.user.name})
    env.update(dict.fromkeys(CA_VARIABLES, ca))
    return env
