"""The ``tether`` dispatcher: the parser built from each command's ``add_*`` function, ``--version``, and how a
command's end becomes an exit status. No user error ends in a traceback.

Exit codes: 0 success, 1 a negative verdict (invalid chain, widening found, termination incomplete),
2 bad input or a refusal from the control plane (the stable code is printed first), 3 a sidecar whose chain
may no longer serve, 130 Ctrl-C, 141 the reader of our output went away (``tether agents | head``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, when it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "(default" in text or not action.option_strings:
            return text
        if action.default in (None, False, [], "", argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


COMMAND_PARSER = "_command_parser"  # the namespace's note of the (innermost) command that was chosen


class Commands(argparse._SubParsersAction):
    """A command's parser, chosen: arguments it does not know are its error (with its own usage, not the top
    level's), and its one-line help is its description too unless it has a longer one."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if kwargs.get("help") and "description" not in kwargs:
            text = str(kwargs["help"])
            kwargs["description"] = text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
        return super().add_parser(name, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        chosen = self._name_parser_map.get(values[0]) if values else None
        super().__call__(parser, namespace, values, option_string)
        if chosen is None:
            return
        if not hasattr(namespace, COMMAND_PARSER):  # an inner command (grant issue) noted itself first
            setattr(namespace, COMMAND_PARSER, chosen)
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            delattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR)
            getattr(namespace, COMMAND_PARSER).error(f"unrecognized arguments: {' '.join(extras)}")


class Parser(argparse.ArgumentParser):
    """Sub-parsers share the formatter and the ``Commands`` action; a usage error prints the usage of the command
    it is about and one line with a code (``tether.usage``), exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Commands)

    def error(self, message: str) -> NoReturn:
        usage_error(self, message)


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    from tether.capability.errors import USAGE

    parser.print_usage(sys.stderr)
    print(f"error: {USAGE}: {parser.prog}: {message} (see {parser.prog} --help)", file=sys.stderr)
    sys.exit(2)


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


# Every command, in --help's order: its name, the module of this package that adds it ("" for this one) and the
# function that does. A module is imported only when its command is built: a command given on the command line is
# built alone (``main``), so `tether sidecar` loads none of the other commands' modules (bench/RESULTS.md, "Idle
# RSS"); `tether --help` and `tether --version` build them all.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("demo", "", "add_demo"), ("example", "example", "add_example"),
    ("controlplane", "controlplane", "add_controlplane_group"), ("sidecar", "sidecar", "add_sidecar"),
    ("run", "run", "add_run"), ("node", "node", "add_node"), ("mcp", "mcp_stdio", "add_mcp"),
    ("keygen", "grant", "add_keygen"), ("keys", "keys", "add_keys"), ("grant", "grant", "add_grant"),
    ("revoke", "agents", "add_revoke"), ("agents", "agents", "add_agents"), ("budgets", "budgets", "add_budgets"),
    ("terminate", "ops", "add_terminate"), ("terminations", "ops", "add_terminations"),
    ("approvals", "ops", "add_approvals"), ("records", "ops", "add_records"), ("audit", "audit", "add_audit"),
    ("capture", "capture", "add_capture"), ("operators", "operators", "add_operators"),
    ("login", "login", "add_login"), ("witness", "witness", "add_witness"),
    ("completion", "completion", "add_completion"),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``only``) the top level with that one command under it."""
    parser = Parser(prog="tether", description="Make a fleet of AI agents stoppable.",
                    epilog="Each command describes itself: tether COMMAND --help. Listings and verdicts take --json; "
                    "errors start with a stable code (docs/cli.md). Shell completion: tether completion bash|zsh|tcsh.")
    parser.add_argument("--version", action=Version, help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, module, adder in COMMANDS:
        if only is None or name == only:
            owner = importlib.import_module(f"{__package__}.{module}") if module else sys.modules[__name__]
            getattr(owner, adder)(sub)
    return parser


def command_named(argv: Sequence[str]) -> str | None:
    """The command the command line names first, when it is one (``sidecar`` in ``tether sidecar ...``)."""
    return argv[0] if argv and argv[0] in {name for name, _, _ in COMMANDS} else None


class Version(argparse.Action):
    """``--version``, its number looked up only when asked for (importlib.metadata is not light)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"tether {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tether")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    from tether.capability.errors import USAGE, TetherError

    args = None
    try:
        given = sys.argv[1:] if argv is None else list(argv)
        args = build_parser(command_named(given)).parse_args(given)  # bad usage: its usage, tether.usage, exit 2
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that left is a BrokenPipeError we handle, not at exit
        return code
    except TetherError as exc:
        if exc.code == USAGE and getattr(args, COMMAND_PARSER, None) is not None:
            getattr(args, COMMAND_PARSER).print_usage(sys.stderr)
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _forget_interrupt()
        return 130
    except BrokenPipeError:  # `tether records show ID | head`: the reader left, nothing is wrong
        _quiet_stdout()
        return 141
    except OSError as exc:  # a file or socket the user named: no traceback for what they can fix
        from tether.capability.errors import IO_FAILED

        print(f"error: {IO_FAILED}: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}",
              file=sys.stderr)
        return 2


def _forget_interrupt() -> None:
    """Tell CPython the Ctrl-C was handled, so ``python -m tether`` exits 130 and not by SIGINT.

    A KeyboardInterrupt that ends code run from a string (``exec("...")``, as every ``@dataclass`` runs when a
    module defining one is imported) sets an interpreter flag that a caller catching the exception does not
    clear; under ``-m`` the interpreter checks it at exit and kills itself with SIGINT, whatever status the
    program returned. So a Ctrl-C that landed during an import ended ``tether run`` by the signal. The flag is
    cleared at the start of every string evaluation: one that ends normally leaves it cleared."""
    exec("pass")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's last flush must not fail again on the closed pipe."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
