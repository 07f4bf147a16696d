"""How commands print: JSON for ``--json``, times, and capabilities as one line."""

from __future__ import annotations

import json
import time
from typing import Any


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def ago(ts: float | None) -> str:
    if not ts:
        return "never"
    delta = time.time() - ts
    return f"{delta:.0f}s ago" if delta >= 0 else f"in {-delta:.0f}s"


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def caps_text(caps: dict[str, Any]) -> str:
    """Caps (tiers or budget objects) as ``cap=direct,calls=20, other=approval``."""
    from tether.capability.budget import read_grant
    from tether.capability.catalog import TIERS

    return ", ".join(f"{c}={read_grant(t, tiers=TIERS).text() if isinstance(t, dict) else t}"
                     for c, t in sorted(caps.items())) or "nothing"
