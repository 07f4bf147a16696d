"""mitmproxy with exactly the addons a tether sidecar loads, and none of tether's own: the baseline that
isolates what tether's enforcement, tracking, reporting and capture cost.

Run: python bench/minimal_mitmproxy.py PORT CONFDIR UPSTREAM_CA
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mitmproxy import options

from tether.proxy.mitmaddons import Master
from tether.proxy.sidecar import mitmproxy_addons


async def main(port: int, confdir: str, upstream_ca: str) -> None:
    master = Master(options.Options(listen_host="127.0.0.1", listen_port=port, confdir=confdir))
    master.addons.add(*mitmproxy_addons())
    master.options.update(connection_strategy="lazy", http2=True, tcp_timeout=600, rawtcp=False,
                          ssl_verify_upstream_trusted_ca=upstream_ca)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, master.shutdown)
    await master.run()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
