"""HTTP/1 framing mitmproxy does not handle: trailer fields of a chunked body.

mitmproxy 12's HTTP/1 layer raises ``NotImplementedError`` when a chunked body ends in trailer fields (a
request's or a response's): a traceback in the sidecar's log and a connection left hanging. RFC 9112 section
7.1.2 lets a recipient that removes the chunked coding discard trailers, and tether does: the body goes on
(re-chunked or not, as mitmproxy frames it), its trailers stop at the sidecar. Forwarding them would also let
a server that merges trailers into its headers read fields tether never decided on (an override header after
the body). ``discard_trailers()`` wraps the body reader mitmproxy makes for every HTTP/1 message.
"""

from __future__ import annotations

import logging
from typing import Any

import h11
from mitmproxy.proxy.layers.http import _http1

log = logging.getLogger("tether.sidecar")


class TrailerlessReader:
    """One of h11's body readers, whose end of message never carries trailer fields."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __call__(self, buf: Any) -> Any:
        event = self.reader(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            names = sorted({name.decode("latin-1") for name, _ in event.headers})
            log.info("discarded the trailer fields %s of a chunked body (trailers are not forwarded)", names)
            return h11.EndOfMessage()
        return event

    def read_eof(self) -> Any:
        return self.reader.read_eof()


def discard_trailers() -> None:
    """Make every HTTP/1 body reader of this process discard trailers (idempotent)."""
    make = _http1.make_body_reader
    if getattr(make, "discards_trailers", False):
        return

    def make_body_reader(expected_size: int | None) -> Any:
        return TrailerlessReader(make(expected_size))

    make_body_reader.discards_trailers = True  # type: ignore[attr-defined]
    _http1.make_body_reader = make_body_reader
