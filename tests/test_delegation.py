"""What a sub-agent's request can make of the delegating ``tether run`` (tether/cli/delegation.py): only the allowed
options, each value one token that never reads as another option. The whole path runs in tests/test_enforced.py."""

from __future__ import annotations

import pytest

from tether.capability.errors import TetherError
from tether.cli.delegation import child_argv
from tether.cli.main import build_parser

SPEC = {"controlplane": "http://127.0.0.1:9", "parent_chain": "parent.chain", "parent_key": "parent.key",
        "state_root": "state"}


def parsed(options: dict) -> object:
    argv = child_argv(options, **SPEC)
    assert argv[1:4] == ["-I", "-m", "tether"]  # isolated: nothing of the requester's environment reaches it
    return build_parser().parse_args([*argv[4:], "--", "true"])


def test_the_allowed_options_reach_the_child_and_the_parent_is_always_the_enclosing_runs() -> None:
    args = parsed({"agent": "researcher", "cap": ["issues.read=direct", "mail.send=approval"], "ttl": 60})
    assert (args.agent, args.cap, args.ttl) == ("researcher", ["issues.read=direct", "mail.send=approval"], 60.0)
    assert (args.parent_chain, args.parent_key, args.state_dir) == ("parent.chain", "parent.key", "state")


@pytest.mark.parametrize("value", ["--secret=x=file:parent.key", "--cooperative", "-k"])
def test_a_value_never_becomes_another_option(value: str) -> None:
    args = parsed({"agent": value})
    assert args.agent == value and args.secret is None and not args.cooperative and args.key is None


@pytest.mark.parametrize("options", [{"secret": ["x=env:Y"]}, {"cooperative": True}, {"state_dir": "/"},
                                     {"agent": True}, {"cap": [{"x": 1}]}])
def test_anything_else_is_refused(options: dict) -> None:
    with pytest.raises(TetherError) as err:
        child_argv(options, **SPEC)
    assert err.value.code == "tether.bad_request"
