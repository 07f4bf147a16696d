"""The ``tether`` dispatcher: the parser built from each command's ``add_*`` function, ``--version``, and how a
command's end becomes an exit status. No user error ends in a traceback.

Exit codes: 0 success, 1 a negative verdict (invalid chain, widening found, termination incomplete),
2 bad input or a refusal from the control plane (the stable code is printed first), 3 a sidecar whose chain
may no longer serve, 130 Ctrl-C, 141 the reader of our output went away (``tether agents | head``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from . import (
    agents,
    audit,
    budgets,
    capture,
    controlplane,
    example,
    grant,
    keys,
    login,
    mcp_stdio,
    operators,
    ops,
    run,
    sidecar,
    witness,
)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, when it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "(default" in text or not action.option_strings:
            return text
        if action.default in (None, False, [], "", argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Sub-parsers share the formatter; an unknown command lists the ones there are."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole story on an embedded store, no setup")
    p.add_argument("--dir", default=None, help="where to keep the demo's files (default: a temp dir)")
    p.add_argument("--fast", action="store_true", help="shorter pauses")
    p.add_argument("--console", action="store_true",
                   help="decide the held call in the web console, and keep the console up at the end")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import cmd_demo

    return cmd_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tether", description="Make a fleet of AI agents stoppable.")
    parser.add_argument("--version", action="version", version=f"tether {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    add_demo(sub)
    example.add_example(sub)
    controlplane.add_controlplane_group(sub)
    sidecar.add_sidecar(sub)
    run.add_run(sub)
    mcp_stdio.add_mcp(sub)
    grant.add_keygen(sub)
    keys.add_keys(sub)
    grant.add_grant(sub)
    agents.add_revoke(sub)
    agents.add_agents(sub)
    budgets.add_budgets(sub)
    ops.add_terminate(sub)
    ops.add_terminations(sub)
    ops.add_approvals(sub)
    ops.add_records(sub)
    audit.add_audit(sub)
    capture.add_capture(sub)
    operators.add_operators(sub)
    login.add_login(sub)
    witness.add_witness(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tether")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    from tether.capability.errors import TetherError

    try:
        args = build_parser().parse_args(argv)  # bad usage: argparse says so and exits 2
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that left is a BrokenPipeError we handle, not at exit
        return code
    except TetherError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tether records show ID | head`: the reader left, nothing is wrong
        _quiet_stdout()
        return 141
    except OSError as exc:  # a file or socket the user named: no traceback for what they can fix
        print(f"error: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", file=sys.stderr)
        return 2


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's last flush must not fail again on the closed pipe."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
