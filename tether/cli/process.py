"""What every long-running command shares: waiting for the signal that stops it, and a failed listen said
plainly."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
from collections.abc import Callable

from tether.capability.errors import LISTEN_FAILED, TetherError


async def wait_for_signal(ready: Callable[[], None] | None = None) -> int:
    """Wait for SIGTERM or SIGINT (``ready`` is called once both are caught); returns the one that came."""
    stop = asyncio.Event()
    stopped_by: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda sig=sig: (stopped_by.append(sig), stop.set()))
    if ready is not None:
        ready()
    await stop.wait()
    return stopped_by[0]


def listen_error(what: str, exc: OSError) -> TetherError:
    """A listen that failed, said plainly: an address in use names the usual way out."""
    if exc.errno == errno.EADDRINUSE:
        return TetherError(f"{what}: the address is in use (another process listens there; pick another with "
                           "--listen)", code=LISTEN_FAILED)
    return TetherError(f"{what}: {exc.strerror or exc}", code=LISTEN_FAILED)
