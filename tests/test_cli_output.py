"""What the CLI prints of attacker-controlled text (held calls, call URLs) cannot drive the terminal."""

from __future__ import annotations

import time

import pytest

from tether.cli.ops import print_approval, print_record_summary

HOSTILE_BODY = '{"title":"delete all customer data"}\r\x1b[2K{"title":"fix typo in README"}\x1b[8m'


def test_a_held_calls_body_and_headers_are_shown_with_control_characters_escaped(
        capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"id": "apr-1", "status": "pending", "requested_at": time.time(), "agent": "a", "chain": ["a"],
           "capability": "tickets.write", "deciders": ["admin"],
           "request": {"method": "POST", "url": "http://tool/\x1b]8;;evil\x07tickets", "call_hash": "sha256:x",
                       "headers": [["X-Note", "ok\r\x1b[1Ahidden"]], "body": HOSTILE_BODY, "body_encoding": "text",
                       "body_size": len(HOSTILE_BODY)}}
    print_approval(doc)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "delete all customer data" in out and "\\x1b[2K" in out and "\\r" in out


def test_a_records_call_urls_are_shown_with_control_characters_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    record = {"record_id": "rec-1", "termination_id": "term-1", "mode": "drain", "subject": "a",
              "requested_by": "admin", "requested_at": 0.0, "completed_at": 1.0, "window_s": 1.0,
              "calls": [{"call_id": "c", "agent": "a", "capability": None, "method": "GET",
                         "url": "http://tool/x\x1b[2J", "resolution": "refused", "status": None}],
              "agents_terminated": [], "agents_unaccounted": [], "leases": [], "hash": "h", "prev_hash": ""}
    print_record_summary(record)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2J" in out


def test_version() -> None:
    import subprocess

    from .harness import PYTHON

    out = subprocess.run([PYTHON, "-m", "tether", "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("tether ") and out.stdout.split()[1][0].isdigit(), out
