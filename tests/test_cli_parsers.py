"""The parser as a user reads it: every command of docs/contract.md section 7 is there, and every option says what it
is for (and, through the help formatter, its default)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from tether.cli.main import build_parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                            argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def test_every_option_of_every_command_has_help() -> None:
    missing = [f"tether {' '.join(path)} {action.option_strings or action.dest}"
               for path, parser in commands(build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()]
    assert missing == []


def test_help_shows_each_default() -> None:
    text = " ".join(next(p for path, p in commands(build_parser()) if path == ("sidecar",)).format_help().split())
    assert "(default: 300.0)" in text and "(default: 120.0)" in text and "(default: 127.0.0.1:8080)" in text
    assert "$XDG_STATE_HOME/tether/AGENT" in text  # the state dir's default, outside the working directory


@pytest.mark.parametrize("line", [
    "demo",
    "controlplane serve --store sqlite:///x.db --listen 127.0.0.1:7000 --catalog c.yaml --signing-key k",
    "sidecar --controlplane http://h:1 --chain c --key k --listen 127.0.0.1:8080",
    "run --controlplane http://h:1 --chain c --key k -- python agent.py",
    "run --controlplane http://h:1 --parent-chain c --parent-key k --cap a=direct -- python agent.py",
    "keygen --out k",
    "grant issue --signing-key k --catalog c --agent a --subject-key k.pub --cap a=direct --ttl 60 --depth 2",
    "grant delegate --chain c --key k --agent a --subject-key k.pub --cap a=direct --ttl 60",
    "grant verify --chain c --trust k.pub --revoked j1 j2",
    "grant verify --chain c --controlplane http://h:1",
    "revoke JTI", "revoke --agent a", "agents --tree",
    "terminate a --mode drain --window 5", "terminate a --mode abort",
    "approvals list", "approvals approve ID", "approvals deny ID",
    "records list", "records show ID", "records verify",
    "audit surface --agent a --json", "audit diff old.json new.json",
    "capture export --agent a --har f.har", "capture export --termination t --har f.har",
])
def test_the_design_command_lines_parse(line: str) -> None:
    args = build_parser().parse_args(line.split())
    assert callable(args.func)
