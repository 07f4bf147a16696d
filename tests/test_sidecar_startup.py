"""A control plane that stalls while a sidecar starts does not kill the sidecar: every start-up step is kept
trying (issue 29, item 2).

Between each sidecar and the control plane runs a relay that, at one chosen moment of the start-up (before the
first, second, ... sixth request it carries: trust, catalog, registration, first heartbeat, first event sync, the
heartbeat that begins serving), freezes every byte in both directions for 7 s: longer than a heartbeat's 5 s
timeout. Six sidecars start at once, one per moment. Each must come up, say it is waiting while it waits, and
forward a granted call; none may exit.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from .conftest import World
from .harness import PYTHON, free_port, wait_until

FREEZE_S = 7.0
MOMENTS = range(6)


class FreezingRelay:
    """TCP from a free port to ``target``; before forwarding request number ``freeze_at`` (counted from 0 by
    request lines), every byte in both directions waits ``FREEZE_S``."""

    def __init__(self, target: int, freeze_at: int) -> None:
        self.port = free_port()
        self.target = target
        self.freeze_at = freeze_at
        self.requests = 0
        self.frozen_until = 0.0
        self.froze = False
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            await asyncio.start_server(self._client, "127.0.0.1", self.port)
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer, count=True), self._pump(up_reader, writer, count=False),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        try:
            while data := await reader.read(65536):
                if count:
                    self.requests += data.count(b" HTTP/1.1\r\n")
                    if not self.froze and self.requests > self.freeze_at:
                        self.froze = True
                        self.frozen_until = time.monotonic() + FREEZE_S
                while time.monotonic() < self.frozen_until:
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_sidecar_keeps_trying_through_a_control_plane_frozen_at_each_moment_of_its_start_up(
        world: World, tmp_path: Path) -> None:
    relays = [FreezingRelay(world.cp.port, moment) for moment in MOMENTS]
    procs = []
    try:
        for moment, relay in zip(MOMENTS, relays, strict=True):
            ident = world.cp.issue(f"frozen-{moment}", {"issues.read": "direct"})
            state = tmp_path / f"s{moment}"
            state.mkdir()
            log = open(state / "sidecar.log", "wb")
            procs.append((subprocess.Popen(
                [PYTHON, "-m", "tether", "sidecar", "--controlplane", f"http://127.0.0.1:{relay.port}", "--chain",
                 str(ident.chain_path), "--key", str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir",
                 str(state), "--ready-file", str(state / "ready.json")], stdout=log, stderr=log,
                env=world.cp.env()), state))
        for moment, (proc, state) in zip(MOMENTS, procs, strict=True):
            def up(proc: subprocess.Popen = proc, state: Path = state) -> bool:
                assert proc.poll() is None, (proc.returncode, (state / "sidecar.log").read_text()[-2000:])
                return (state / "ready.json").exists()

            wait_until(up, 90, what=f"the sidecar frozen at moment {moment}")
        import json

        for moment, ((proc, state), relay) in enumerate(zip(procs, relays, strict=True)):
            assert relay.froze, f"moment {moment}: the start-up made fewer requests than expected"
            proxy = json.loads((state / "ready.json").read_text())["proxy"]
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))

            def served(opener: urllib.request.OpenerDirector = opener, moment: int = moment) -> bool:
                try:
                    with opener.open(f"{world.tools.base}/repos/frozen/{moment}/issues", timeout=10) as resp:
                        return resp.status == 200
                except OSError:
                    return False  # 503 tether.lease_expired until a heartbeat is answered

            wait_until(served, 60, interval=0.5, what=f"a call through the sidecar frozen at moment {moment}")
            assert proc.poll() is None
        logs = [(state / "sidecar.log").read_text() for _, state in procs]
        assert any("waiting for the control plane" in text for text in logs), logs
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for relay in relays:
            relay.stop()
