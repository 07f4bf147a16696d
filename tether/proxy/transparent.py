"""Transparent interception: where a redirected connection was going, by name, as explicit mode knows it.

A connection redirected to the sidecar (``iptables REDIRECT``: the egress lock in a pod, ``tether run
--isolate`` on one machine) carries its original destination address (SO_ORIGINAL_DST, read by mitmproxy's
transparent mode). tether does not trust that address to mean anything: the destination is the *name* the
client asked for, the TLS server name for TLS and the ``Host`` header for plain HTTP, at the port it dialled.
The sidecar resolves that name itself, as it does for an explicit proxy request, so the call is matched to
the catalog exactly as in explicit mode, and a client cannot reach an address of its choosing by naming a
granted host (the sidecar never connects to the redirected address when a name was given). Without a name
(TLS without SNI, HTTP/1.0 without Host) the address itself is the destination: the catalog must name it.

The sockets ``tether run``'s enclosure makes in its own network namespace are served here too
(:func:`serve_enclosure`): the same transparent connections, accepted by the sidecar outside the namespace.

Also here: the resolver an isolated command is given. Every name resolves to the sidecar's transparent
address (AAAA: no address), so any client, whatever transport it brings, dials the sidecar; nothing is
forwarded, so DNS is no channel out either, and the sidecar answers an ungranted name with the same
``tether.unknown_destination`` an explicit-mode client gets.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Any

from mitmproxy import dns, http
from mitmproxy.net.dns import response_codes, types
from mitmproxy.proxy.mode_servers import ServerInstance
from mitmproxy.proxy.mode_specs import TransparentMode

log = logging.getLogger("tether.sidecar.transparent")


def is_transparent(conn: Any) -> bool:
    return isinstance(getattr(conn, "proxy_mode", None), TransparentMode)


def host_name(host_header: str) -> str:
    """The name part of a Host header (an IPv6 literal keeps its brackets off, as mitmproxy keeps hosts)."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if ":" in host_header else host_header


class Transparent:
    """First in the pipeline: before a call is tracked, its destination is the name the client asked for."""

    def tls_clienthello(self, data: Any) -> None:
        server = data.context.server
        if not is_transparent(data.context.client) or server.address is None:
            return
        sni = data.client_hello.sni
        if sni:
            server.address = (sni.rstrip("."), server.address[1])

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if not is_transparent(flow.client_conn) or flow.client_conn.tls:
            return  # TLS: the request's host is the server name chosen above
        name = host_name(flow.request.host_header or "")
        if name:
            flow.request.data.host = name  # the port stays the one dialled; a Host naming another is refused


class Resolver(asyncio.DatagramProtocol):
    """A DNS responder over UDP that answers every A query with one address and nothing else."""

    def __init__(self, answer: str) -> None:
        self.answer = ipaddress.IPv4Address(answer)
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def reply(self, data: bytes) -> bytes | None:
        try:
            query = dns.DNSMessage.unpack(data)
        except Exception:  # not DNS: no answer at all
            return None
        question = query.question
        if not query.query or question is None:
            return query.fail(response_codes.FORMERR).packed if query.query else None
        if question.type == types.PTR:
            return query.fail(response_codes.NXDOMAIN).packed
        if question.type == types.A:
            return query.succeed([dns.ResourceRecord.A(question.name, self.answer, ttl=5)]).packed
        return query.succeed([]).packed  # a name exists, with no record of that type (AAAA, MX, TXT ...)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        answer = self.reply(data)
        if answer is not None and self.transport is not None:
            self.transport.sendto(answer, addr)


async def serve_dns(host: str, port: int, answer: str) -> asyncio.DatagramTransport:
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: Resolver(answer),
                                                                             local_addr=(host, port))
    log.info("resolver on %s:%d answers every name with %s", host, port, answer)
    return transport


async def serve_enclosure(manager: Any, listener_fd: int, resolver_fd: int,
                          answer: str) -> tuple[asyncio.Server, asyncio.DatagramTransport]:
    """Serve the sockets ``tether run``'s enclosure made in its network namespace (tether/proxy/rootless.py): every TCP
    connection the command opens is accepted here, in the sidecar, as a transparent-mode connection of mitmproxy's
    (``manager`` is its proxyserver, which then tracks and closes it like any other); its original destination is
    read from the namespace's conntrack, where the socket lives. Every DNS query is answered with ``answer``."""
    loop = asyncio.get_running_loop()
    instance = ServerInstance.make(TransparentMode.parse("transparent"), manager)
    listener = socket.socket(fileno=listener_fd)
    listener.setblocking(False)
    server = await asyncio.start_server(instance.handle_stream, sock=listener)
    resolver = socket.socket(fileno=resolver_fd)
    resolver.setblocking(False)
    transport, _ = await loop.create_datagram_endpoint(lambda: Resolver(answer), sock=resolver)
    log.info("serving the enclosure's connections (every name resolves to %s)", answer)
    return server, transport
