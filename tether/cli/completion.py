"""``tether completion bash|zsh|tcsh``: a shell completion script generated from the parser itself (shtab), so
every command, option and choice the parser knows completes, and nothing it does not. Options that name a file
or a directory complete paths."""

from __future__ import annotations

import argparse
import re
from typing import Any

SHELLS = ("bash", "zsh", "tcsh")
_FILE_METAVAR = re.compile(r"^(F|F\.\w+|\w+\.(json|pub|pem|har|yaml))$")


def add_completion(sub: Any) -> None:
    p = sub.add_parser("completion", help="print a shell completion script (bash, zsh or tcsh)",
                       description="Print a completion script for SHELL, made from tether's own parser. bash: "
                       "`source <(tether completion bash)` (or save it as ~/.local/share/bash-completion/completions/"
                       "tether); zsh: `tether completion zsh > \"${fpath[1]}/_tether\"` then `compinit`; tcsh: "
                       "`eval \"`tether completion tcsh`\"`.")
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=cmd_completion)


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    from .main import build_parser

    parser = build_parser()
    mark_paths(parser, shtab.FILE, shtab.DIRECTORY)
    print(shtab.complete(parser, shell=args.shell))
    return 0


def mark_paths(parser: argparse.ArgumentParser, file: Any, directory: Any) -> None:
    """Give every option (and positional) that names a file or directory shtab's path completion, in every
    command: what the parser's metavars say (``F``, ``F.pub``, ``DIR``, ``OLD.json`` ...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                mark_paths(sub, file, directory)
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else ""
        if metavar == "DIR":
            action.complete = directory  # type: ignore[attr-defined]
        elif _FILE_METAVAR.match(metavar) or action.dest in ("old", "new"):
            action.complete = file  # type: ignore[attr-defined]
