"""The enclosure's inside (tether/proxy/inside.py; issue 28 item 1) is a fresh interpreter that loads only C modules
of the standard library and ctypes: no tether, no site hooks, nothing of typing, json, subprocess or dataclasses.
Its channel carries plain values and descriptors; its command runner captures output and a status as
``subprocess.run`` did. The enclosure itself, end to end, is tests/test_enforced.py's."""

from __future__ import annotations

import marshal
import os
import socket
import subprocess

import pytest

from tether.proxy import inside

from .harness import PYTHON

HEAVY = ("typing", "json", "subprocess", "dataclasses", "pathlib", "re", "enum", "socket", "signal", "tether", "site")


def test_the_inside_loads_no_python_module_it_does_not_need() -> None:
    """As the enclosure starts it (``python -I -S inside.py``, PATH and LANG only), but not as ``__main__``."""
    code = (f"import sys\nbefore = set(sys.modules)\nsrc = open({inside.__file__!r}).read()\n"
            "exec(compile(src, 'inside', 'exec'), {'__name__': 'probe'})\n"
            "print(' '.join(sorted(set(sys.modules) - before)))\n")
    out = subprocess.run([PYTHON, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ["PATH"], "LANG": "C"}, check=True)
    loaded = out.stdout.split()
    assert "ctypes" in loaded and "select" in loaded, loaded
    assert [m for m in loaded if m.split(".")[0] in HEAVY] == [], loaded


def test_the_channel_carries_plain_values_and_descriptors() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        plan = {"command": ["sh", "-c", "echo hi"], "env": {"PATH": "/bin", "X": "é"}, "cwd": "/",
                "mounts": [{"source": "", "target": "/x", "directory": True}]}
        inside.send_values(ours, plan, fds=[r, w])
        inside.send_values(ours, {"started": True})
        doc, fds = inside.receive_values(theirs)
        assert doc == plan and len(fds) == 2
        os.write(fds[1], b"through")
        assert os.read(r, 10) == b"through"
        for fd in fds:
            os.close(fd)
        assert inside.receive_values(theirs) == ({"started": True}, [])
        ours.close()
        with pytest.raises(EOFError):
            inside.receive_values(theirs)
    finally:
        theirs.close()
        os.close(r)
        os.close(w)


def test_a_message_too_large_or_not_a_dict_is_refused() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        ours.sendall((inside.MAX_MESSAGE + 1).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="at most"):
            inside.receive_values(theirs)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        data = marshal.dumps([1, 2])
        ours.sendall(len(data).to_bytes(4, "big") + data)
        with pytest.raises(ValueError, match="dicts only"):
            inside.receive_values(theirs)


def test_the_command_runner_captures_output_status_and_a_timeout() -> None:
    assert inside.run_command(["sh", "-c", "echo out; echo err >&2; exit 3"]) == (3, "out\nerr\n")
    assert inside.run_command(["true"]) == (0, "")
    status, out = inside.run_command(["sleep", "30"], timeout_s=0.5)
    assert status == -9 and "killed after" in out
    with pytest.raises(FileNotFoundError):
        inside.run_command(["tether-no-such-command"])
