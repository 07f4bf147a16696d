"""What a command needs to talk to a control plane: the ``--controlplane`` option, an admin client, signing
as a chain holder, and ids as URL path segments. The client itself is imported only when a command calls."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from tether.controlplane.client import Client, Signer

DEFAULT_CONTROLPLANE = "http://127.0.0.1:7000"


def add_controlplane(p: argparse.ArgumentParser, help: str = "the control plane's URL") -> None:
    # The default is read when the parser is built; None (no variable) means DEFAULT_CONTROLPLANE, except where a
    # command tells "not given" apart (grant verify: offline with --trust).
    p.add_argument("--controlplane", metavar="URL", default=os.environ.get("TETHER_CONTROLPLANE"),
                   help=f"{help} (default: $TETHER_CONTROLPLANE, else {DEFAULT_CONTROLPLANE})")


def controlplane_url(args: argparse.Namespace) -> str:
    return args.controlplane or DEFAULT_CONTROLPLANE


def client(args: argparse.Namespace) -> Client:
    from tether.controlplane.client import Client

    return Client(controlplane_url(args))


def signer_from(chain_path: str, key_path: str) -> Signer:
    from tether.capability import keys
    from tether.capability.chain import parse_chain_unverified
    from tether.capability.shared import read_chain, read_file
    from tether.controlplane.client import Signer

    links = parse_chain_unverified(read_chain(chain_path))
    key = keys.load_private(read_file(key_path, "key"), key_path)
    return Signer(agent=links[-1].sub, link=links[-1].hash, key=key)


def path_segment(value: str) -> str:
    """An id as one URL path segment: ``/``, ``?``, ``#``, spaces and the rest percent-encoded, so an odd id
    names that id (and gets a clean "not found") instead of another route."""
    segment = quote(value, safe=":")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment  # never a dot segment


def check_jti(text: str) -> str:
    """A jti as typed (or copied from a listing, ellipsis and all), checked before anything is sent: the whole
    jti, or a prefix of at least 8 hex characters the control plane resolves (``tether.jti_ambiguous`` when it
    begins several links' jtis)."""
    from tether.capability.jti import check_prefix

    return check_prefix(text)
