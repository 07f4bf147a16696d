"""How commands print: JSON for ``--json``, times (ISO 8601, UTC), tables, colour, and capabilities as one line."""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Sequence
from typing import Any, TextIO


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def iso(ts: float | None) -> str:
    """A time as ISO 8601 in UTC, to the second (``2026-12-03T09:54:26Z``); ``-`` for none."""
    if not ts:  # None, or a zero that stands for "never"
        return "-"
    moment = datetime.datetime.fromtimestamp(float(ts), datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


when = iso  # every time a command prints is one of these: never an epoch number, never a time without its zone


def ago(ts: float | None) -> str:
    """How long ago (or how far ahead) ``ts`` is, for a reader deciding now; the ``--json`` answer has the time."""
    if not ts:
        return "never"
    delta = time.time() - ts
    return f"{delta:.0f}s ago" if delta >= 0 else f"in {-delta:.0f}s"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows under a header, each column as wide as its widest cell (the last column left ragged)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in (header, *rows)]


def colour(stream: TextIO) -> bool:
    """Whether to colour what goes to ``stream``: a terminal, and neither ``NO_COLOR`` (https://no-color.org: set
    and not empty) nor ``TERM=dumb``."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def styled(text: str, style: str, stream: TextIO) -> str:
    """``text`` in ``style`` (``bold``, ``red``, ``green``, ``yellow``, ``dim``) where ``colour(stream)``."""
    codes = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33"}
    return f"\033[{codes[style]}m{text}\033[0m" if colour(stream) else text


def caps_text(caps: dict[str, Any]) -> str:
    """Caps (tiers or budget objects) as ``cap=direct,calls=20, other=approval``."""
    from tether.capability.budget import read_grant
    from tether.capability.catalog import TIERS

    return ", ".join(f"{c}={read_grant(t, tiers=TIERS).text() if isinstance(t, dict) else t}"
                     for c, t in sorted(caps.items())) or "nothing"
