"""``tether run``: put an unmodified command under a sidecar.

It starts ``tether sidecar`` as a separate process, waits until the proxy listens, then runs the command
with ``HTTP_PROXY``/``HTTPS_PROXY`` and the CA variables set (``NO_PROXY`` emptied, so nothing bypasses
it). With ``--parent-chain/--parent-key`` it first delegates a narrower chain to a fresh key for the
child. When the command exits, the sidecar is stopped cleanly; the command's exit code is returned.
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
from pathlib import Path

from capability import keys
from capability.chain import mint_child, parse_chain_unverified
from capability.errors import BAD_REQUEST, TetherError
from capability.shared import parse_caps, read_chain, read_file, write_secret

from .credentials import SecretSpec

CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE")


def _delegate(args: argparse.Namespace, state_root: Path) -> tuple[str, str, str]:
    """Mint a child link for the command; returns (chain path, key path, agent)."""
    parent_wire = read_chain(args.parent_chain)
    parent = parse_chain_unverified(parent_wire)[-1]
    parent_key = keys.load_private(read_file(args.parent_key, "parent key"), args.parent_key)
    agent = args.agent or f"{parent.sub}.{uuid.uuid4().hex[:6]}"
    child_key = keys.generate()
    child = mint_child(parent, parent_key, agent=agent, subject_key=child_key.public_key(),
                       caps=parse_caps(args.cap), now=time.time(), ttl_s=args.ttl)
    directory = state_root / agent
    directory.mkdir(parents=True, exist_ok=True)
    chain_path, key_path = directory / "chain", directory / "key"
    chain_path.write_text(f"{parent_wire},{child}\n")
    write_secret(str(key_path), keys.private_pem(child_key))
    return str(chain_path), str(key_path), agent


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise TetherError("give the command after --, e.g. tether run --chain c --key k -- python agent.py",
                          code=BAD_REQUEST)
    state_root = Path(args.state_dir or ".tether")
    if args.parent_chain:
        if not args.parent_key or not args.cap:
            raise TetherError("--parent-chain needs --parent-key and at least one --cap NAME=TIER", code=BAD_REQUEST)
        chain_path, key_path, agent = _delegate(args, state_root)
    elif args.chain and args.key:
        chain_path, key_path = args.chain, args.key
        agent = parse_chain_unverified(read_chain(chain_path))[-1].sub
    else:
        raise TetherError("give --chain and --key, or --parent-chain, --parent-key and --cap", code=BAD_REQUEST)

    controlplane = args.controlplane or os.environ.get("TETHER_CONTROLPLANE") or "http://127.0.0.1:7000"
    state_dir = state_root / agent
    state_dir.mkdir(parents=True, exist_ok=True)
    secrets = [SecretSpec.parse(text) for text in args.secret or []]
    isolation = None
    if args.isolate:
        from .isolate import DNS_PORT, TRANSPARENT_PORT, Isolation

        os.chmod(state_dir, 0o700)  # the CA key, spool and captures: the sidecar's, not the command's
        isolation = Isolation.create(args.user)
    ready = state_dir / "sidecar.ready"
    ready.unlink(missing_ok=True)
    sidecar_cmd = [sys.executable, "-m", "controlplane.cli", "sidecar", "--controlplane", controlplane,
                   "--chain", chain_path, "--key", key_path, "--listen", args.listen,
                   "--state-dir", str(state_dir), "--ready-file", str(ready),
                   "--approval-timeout", str(args.approval_timeout)]
    if args.upstream_ca:
        sidecar_cmd += ["--upstream-ca", args.upstream_ca]
    for text in args.secret or []:
        sidecar_cmd += ["--secret", text]
    if isolation is not None:
        host = isolation.plan.host_ip
        sidecar_cmd += ["--transparent-listen", f"{host}:{TRANSPARENT_PORT}", "--dns-listen", f"{host}:{DNS_PORT}"]
    log_path = state_dir / "sidecar.log"
    sidecar = None
    try:
        if isolation is not None:
            isolation.check_unreadable([Path(key_path), *(Path(s.ref) for s in secrets if s.kind == "file")])
        with open(log_path, "ab") as log_file:
            sidecar = subprocess.Popen(sidecar_cmd, stdout=log_file, stderr=log_file, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        info = _wait_ready(sidecar, ready, log_path)
        env = dict(os.environ)
        for spec in secrets:  # the secret is the sidecar's alone: the command never sees the variable
            if spec.kind == "env":
                env.pop(spec.ref, None)
        env["NO_PROXY"] = env["no_proxy"] = ""
        if isolation is None:
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
                env[name] = info["proxy"]
            ca = os.path.abspath(info["ca"])
        else:
            # Every connection is intercepted where it goes: no proxy to follow (or to find out of reach).
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
                env.pop(name, None)
            isolation.check_unreadable(sorted((state_dir / "ca").glob("mitmproxy-ca*.pem")))
            ca = str(isolation.trust(Path(info["ca"])))
            env.update({"HOME": str(isolation.workdir / "home"), "USER": isolation.user.name,
                        "LOGNAME": isolation.user.name})
        for name in CA_VARIABLES:
            env[name] = ca
        env.update({"TETHER_AGENT": agent, "TETHER_CHAIN": os.path.abspath(chain_path),
                    "TETHER_CONTROLPLANE": controlplane, "TETHER_STATE_DIR": os.path.abspath(state_root)})
        if isolation is None:  # an isolated command cannot read the key: naming it would only mislead
            env["TETHER_KEY"] = os.path.abspath(key_path)
        where = info["proxy"] if isolation is None else \
            f"{isolation.plan.host_ip}:{TRANSPARENT_PORT} (isolated in {isolation.plan.netns} as {isolation.user.name})"
        print(f"tether: {agent} runs behind its sidecar at {where} (log {log_path})", file=sys.stderr, flush=True)
        child = subprocess.Popen(isolation.wrap(command) if isolation is not None else command, env=env)
        previous = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s)) for sig in
                    (signal.SIGTERM, signal.SIGINT)}
        try:
            code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code
    finally:
        if sidecar is not None:
            _stop(sidecar)
        if isolation is not None:
            isolation.destroy()


def _die_with_parent() -> None:
    """In the sidecar child: if `tether run` dies (even by SIGKILL), the kernel sends us SIGTERM."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the sidecar outlives a killed parent; stop it by hand
        pass


def _wait_ready(sidecar: subprocess.Popen, ready: Path, log_path: Path, timeout: float = 45.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if sidecar.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise TetherError("the sidecar did not start:\n  " + "\n  ".join(tail), code="tether.sidecar_failed")
        time.sleep(0.05)
    raise TetherError(f"the sidecar did not become ready within {timeout:.0f}s (see {log_path})",
                      code="tether.sidecar_failed")


def _stop(sidecar: subprocess.Popen) -> None:
    if sidecar.poll() is not None:
        return
    sidecar.send_signal(signal.SIGTERM)
    try:
        sidecar.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            sidecar.kill()
        sidecar.wait()
