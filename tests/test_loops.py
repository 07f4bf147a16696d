"""The sidecar's event loop reads an events answer whole before acting on any of it (tether/proxy/loops.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tether.capability.errors import CONTROLPLANE_UNREACHABLE, ApiError
from tether.proxy.loops import ControlLoops


class Seen:
    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []
        self.approvals: list[dict[str, Any]] = []


def loops(seen: Seen) -> ControlLoops:
    return ControlLoops(None, None, None, on_command=seen.commands.append,  # type: ignore[arg-type]
                        on_approval=seen.approvals.append, abort=lambda flow: None, call_timeout_s=60.0,
                        supersedes=None)


@pytest.mark.parametrize("bad", [
    {"kind": "revoke", "payload": {"agent": "a"}},
    {"kind": "revoke", "payload": {"jti": 7}},
    {"kind": "command", "payload": "drain"},
    {"kind": "approval", "payload": None},
])
def test_an_answer_with_an_event_it_cannot_act_on_is_refused_whole_and_the_sequence_kept(bad: dict) -> None:
    seen = Seen()
    run = loops(seen)
    good = {"kind": "command", "payload": {"termination_id": "t-1", "mode": "drain"}}
    with pytest.raises(ApiError) as refused:
        run.apply_events({"events": [good, bad], "next": 9})
    assert refused.value.code == CONTROLPLANE_UNREACHABLE  # retried from where the run was, like a lost connection
    assert (seen.commands, run.seq) == ([], -1)
    run.apply_events({"events": [good], "next": 9})
    assert (seen.commands, run.seq) == ([good["payload"]], 9)
