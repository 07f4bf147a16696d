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
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .delegation import DELEGATE_VARIABLE
from .grant import CAP_METAVAR
from .remote import DEFAULT_CONTROLPLANE, add_controlplane
from .sidecar import SIDECAR_OPTIONS, default_state_root

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
    p.add_argument("--command-env", metavar="F", help=argparse.SUPPRESS)
    p.add_argument("--command-cwd", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command and its arguments")
    p.set_defaults(func=cmd_run)


def sidecar_argv(args: argparse.Namespace, *, chain: str, key: str, state_dir: Path, ready: Path) -> list[str]:
    """The ``tether sidecar`` command line for this run: every sidecar option as given to run."""
    argv = [sys.executable, "-m", "tether", "sidecar", "--controlplane", args.controlplane or DEFAULT_CONTROLPLANE]
    resolved = {"chain": chain, "key": key, "state_dir": str(state_dir), "ready_file": str(ready)}
    for option in SIDECAR_OPTIONS:
        argv += option.argv(resolved[option.dest] if option.dest in SET_BY_RUN else getattr(args, option.dest))
    return argv


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
    from tether.proxy.secrets import SecretSpec

    secrets = [SecretSpec.parse(text) for text in args.secret or []]  # before anything is written
    state_root = Path(args.state_dir) if args.state_dir else default_state_root()
    chain_path, key_path, agent = _identity(args, state_root)
    state_dir = state_root / agent
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = "cooperative" if args.cooperative else "as-user" if args.user else "enforced"
    isolation = enclosure = None
    if mode == "as-user":
        from tether.proxy.isolate import DNS_PORT, TRANSPARENT_PORT, Isolation

        os.chmod(state_dir, 0o700)  # the CA key, spool and captures: the sidecar's, not the command's
        isolation = Isolation.create(args.user)
        host = isolation.plan.host_ip
        args = argparse.Namespace(**{**vars(args), "transparent_listen": f"{host}:{TRANSPARENT_PORT}",
                                     "dns_listen": f"{host}:{DNS_PORT}"})
    elif mode == "enforced":
        from tether.proxy.rootless import Enclosure

        enclosure = Enclosure.open()  # before the sidecar: it serves the sockets the enclosure makes
    ready = Path(args.ready_file) if args.ready_file else state_dir / "sidecar.ready"
    ready.unlink(missing_ok=True)
    log_path = state_dir / "sidecar.log"
    sidecar = delegation = None
    try:
        if isolation is not None:
            isolation.check_unreadable([Path(key_path), *(Path(s.ref) for s in secrets if s.kind == "file")])
        argv = sidecar_argv(args, chain=chain_path, key=key_path, state_dir=state_dir, ready=ready)
        fds: tuple[int, ...] = ()
        if enclosure is not None:
            fds = (enclosure.listener, enclosure.resolver)
            argv += ["--enclosure-fds", f"{fds[0]},{fds[1]}"]
        with open(log_path, "ab") as log_file:
            sidecar = subprocess.Popen(argv, stdout=log_file, stderr=log_file, start_new_session=True,
                                       env=without_authority(os.environ), pass_fds=fds,
                                       preexec_fn=die_with_parent)
        if enclosure is not None:
            enclosure.close_sockets()  # the sidecar's alone now
        info = wait_ready(sidecar, ready, log_path)
        env = _command_env(info, secrets, isolation, enclosure, state_dir, _base_env(args.command_env))
        env.update({"TETHER_AGENT": agent, "TETHER_CONTROLPLANE": args.controlplane or DEFAULT_CONTROLPLANE})
        if enclosure is None:  # enclosed, the chain and state dir are covered: naming them would only mislead
            env.update({"TETHER_CHAIN": os.path.abspath(chain_path), "TETHER_STATE_DIR": os.path.abspath(state_root)})
        if isolation is None and enclosure is None:  # an isolated command cannot read the key
            env["TETHER_KEY"] = os.path.abspath(key_path)
        if enclosure is not None:
            from .delegation import DelegationServer

            chain_copy = enclosure.workdir / "chain"  # the chain is no secret: the command may read and show it
            chain_copy.write_text(Path(chain_path).read_text())
            delegation = DelegationServer(enclosure.workdir / "delegate.sock",
                                          controlplane=args.controlplane or DEFAULT_CONTROLPLANE,
                                          parent_chain=os.path.abspath(chain_path),
                                          parent_key=os.path.abspath(key_path), state_root=os.path.abspath(state_root))
            env.update({"TETHER_CHAIN": str(chain_copy), DELEGATE_VARIABLE: str(delegation.path)})
            print(f"tether: {agent} runs enforced: its only way out is its sidecar (log {log_path})",
                  file=sys.stderr, flush=True)
            _enclose(enclosure, command, env, info, secrets,
                     [state_root, Path(key_path), *([Path(args.parent_key)] if args.parent_key else [])],
                     args.command_cwd or os.getcwd())
            return _wait_command(enclosure.process)
        where = info["proxy"] if isolation is None else \
            f"{isolation.plan.host_ip}:{TRANSPARENT_PORT} (isolated in {isolation.plan.netns} as {isolation.user.name})"
        print(f"tether: {agent} runs behind its sidecar at {where} (log {log_path})", file=sys.stderr, flush=True)
        if isolation is None:
            print(COOPERATIVE_WARNING, file=sys.stderr, flush=True)
        return _run_command(isolation.wrap(command) if isolation is not None else command, env)
    finally:
        if delegation is not None:
            delegation.close()  # its children first: each stops its own sidecar
        if enclosure is not None:
            if enclosure.process.poll() is None:
                enclosure.process.terminate()  # the command first: its calls are the sidecar's to finish
                with contextlib.suppress(subprocess.TimeoutExpired):
                    enclosure.process.wait(timeout=5)
            enclosure.destroy()
        if sidecar is not None:
            stop_sidecar(sidecar, args.stop_window)
        if isolation is not None:
            isolation.destroy()


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


def _run_command(command: list[str], env: dict[str, str]) -> int:
    return _wait_command(subprocess.Popen(command, env=env))


def _wait_command(child: subprocess.Popen) -> int:
    """Wait for the command's end, passing it SIGTERM and SIGINT; its exit status, a death by signal N as 128+N
    (so Ctrl-C, which the command gets too, ends run with 130 as it does the command)."""
    previous = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def die_with_parent() -> None:
    """In the sidecar child: if `tether run` dies (even by SIGKILL), the kernel sends us SIGTERM."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the sidecar outlives a killed parent; stop it by hand
        pass


def wait_ready(sidecar: subprocess.Popen, ready: Path, log_path: Path, timeout: float = 45.0) -> dict:
    """Wait for the sidecar's ready file, showing its status lines as they come: while it says it is still
    trying to reach the control plane, so does run (Ctrl-C gives up)."""
    deadline = time.monotonic() + timeout
    shown = log_path.stat().st_size if log_path.exists() else 0
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        shown, waiting = _relay_status(log_path, shown)
        if waiting:
            deadline = time.monotonic() + timeout
        if sidecar.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise TetherError("the sidecar did not start:\n  " + "\n  ".join(tail), code="tether.sidecar_failed")
        time.sleep(0.05)
    raise TetherError(f"the sidecar did not become ready within {timeout:.0f}s (see {log_path})",
                      code="tether.sidecar_failed")


def _relay_status(log_path: Path, offset: int) -> tuple[int, bool]:
    """Print the sidecar's new ``tether: waiting ...`` lines; returns how far the log was read and whether
    there was one."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset, False
    complete = chunk[: chunk.rfind(b"\n") + 1]
    waiting = [line for line in complete.decode(errors="replace").splitlines() if line.startswith("tether: waiting")]
    for line in waiting:
        print(line, file=sys.stderr, flush=True)
    return offset + len(complete), bool(waiting)


def stop_sidecar(sidecar: subprocess.Popen, window_s: float) -> None:
    """SIGTERM, then time for the sidecar's own stop: its window, the cut calls' last events, its reports."""
    if sidecar.poll() is not None:
        return
    sidecar.send_signal(signal.SIGTERM)
    try:
        sidecar.wait(timeout=window_s + 15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            sidecar.kill()
        sidecar.wait()
