"""``tether keys rotate``: replace the control plane's signing key, announced in the record log.

Run it with every control plane replica stopped (a replica still on the old key refuses to write records after
the rotation, but it would keep issuing chains under that key until stopped). It writes the new key beside the
old one first, then appends the rotation record (signed with the old key, cross-signed with the new one), then
swaps the files; the old pair stays as ``F.replaced-TIME``. Chains issued under the old key are not trusted by
the control plane afterwards: re-issue grants and restart their agents.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


def add_keys(sub: Any) -> None:
    k = sub.add_parser("keys", help="the control plane's signing key (rotate)").add_subparsers(
        dest="keys_command", required=True, metavar="ACTION")
    p = k.add_parser("rotate", help="replace the signing key; the record log announces it and verifies across it")
    p.add_argument("--signing-key", default="tether-signing.key", metavar="F",
                   help="the key in force (replaced by the new one; kept as F.replaced-TIME)")
    p.add_argument("--store", default="sqlite:///tether.db", metavar="URL", help="the control plane's store")
    p.add_argument("--new-key", metavar="F", help="rotate to this key (default: a new one)")
    p.add_argument("--reason", default="", help="kept in the rotation record")
    p.set_defaults(func=cmd_rotate)


def cmd_rotate(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.errors import CONFLICT, FILE_EXISTS, TetherError
    from tether.capability.shared import publish_file, read_file, set_aside

    old = keys.load_private(read_file(args.signing_key, "signing key"), args.signing_key)
    new = keys.load_private(read_file(args.new_key, "new key"), args.new_key) if args.new_key else keys.generate()
    if keys.raw_public(new.public_key()) == keys.raw_public(old.public_key()):
        raise TetherError("the new key is the key in force", code=CONFLICT)
    staged = f"{args.signing_key}.next"
    if not publish_file(staged, keys.private_pem(new)):
        raise TetherError(f"{staged} exists: an earlier rotation stopped half way; check which key the log's last "
                          "record names (tether records list) and remove or use it", code=FILE_EXISTS, path=staged)
    try:
        record = asyncio.run(_append_rotation(args.store, old, new, args.reason, args.signing_key))
    except BaseException:  # nothing was announced: the staged key goes, the key in force stays in force
        os.unlink(staged)
        raise
    now = time.time()
    set_aside(args.signing_key, now)
    set_aside(f"{args.signing_key}.pub", now)
    os.replace(staged, args.signing_key)
    Path(f"{args.signing_key}.pub").write_bytes(keys.public_pem(new.public_key()))
    print(f"rotated: record {record['record_id']} announces key {record['new_key_id']} (was {record['old_key_id']})")
    print(f"{args.signing_key} now holds the new key; the old pair is kept beside it as {args.signing_key}.replaced-*",
          file=sys.stderr)
    print("start the control planes again with it; chains issued under the old key are no longer trusted: "
          "re-issue grants", file=sys.stderr)
    return 0


async def _append_rotation(store_url: str, old: Any, new: Any, reason: str, key_path: str) -> dict[str, Any]:
    from tether.capability.errors import CONFLICT, TetherError
    from tether.controlplane.rotation import cross_sign, rotation_record
    from tether.controlplane.signing import check_head
    from tether.controlplane.store import open_store_url
    from tether.controlplane.termination import seal

    store = open_store_url(store_url)
    await store.open()
    try:
        heads = await store.record_heads()
        head = heads[-1] if heads else None
        check_head(head, old.public_key(), key_path)
        record = rotation_record(record_id="rec-" + os.urandom(8).hex(), prev_hash=head["hash"] if head else "",
                                 old=old, new=new, by=f"{getpass.getuser()}@{socket.gethostname()} (tether keys "
                                 "rotate)", reason=reason, now=time.time())
        sealed = seal(cross_sign(record, new), old)
        if not await store.append_record(sealed):
            raise TetherError("a record was written while rotating: stop every control plane replica and run it "
                              "again", code=CONFLICT)
        return sealed
    finally:
        try:
            await store.close()
        except Exception as exc:  # any failure to close, after the append, must not lose the new key
            print(f"tether: closing the store failed ({exc})", file=sys.stderr)
