"""Review of record form 2 (sealed segments): what a holder of the store or of a served record (not the key)
can change in a record naming segments, and whether ``tether records verify`` (offline, as served) and the
control plane's online verification notice. Real SQLite store, the record API's reader, the real sealer."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

from tether.controlplane import termination as proto
from tether.controlplane.store import open_store_url

from .test_record_index import History, Identities, identities  # noqa: F401  (fixtures)
from .test_segments import sealed_then_more

Doc = dict[str, Any]


def with_forged_chain(record: Doc) -> Doc:
    """The served record with a segment of a chain the record does not name added to ``sealed``, and a call
    made up by the forger attributed to it (in the record's order): no key used."""
    forged = json.loads(json.dumps(record))
    template = forged["calls"][0]
    fake = {**template, "call_id": "forged-call", "url": "http://evil.example/exfiltrate",
            "started_at": template["started_at"] - 1}
    forged["calls"] = [fake, *forged["calls"]]
    forged["sealed"].append({"link": "not-a-link-the-record-names", "seq": 1, "prev": "", "count": 1,
                             "hash": "sha256:00", "signature": "AA", "key_id": "x"})
    forged["calls_from"] = [[len(forged["sealed"]) - 1, 1], *forged["calls_from"]]
    return forged


def test_a_call_attributed_to_a_chain_the_record_does_not_name_is_caught(identities: Identities,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    history, log = asyncio.run(sealed_then_more(f"sqlite:///{tmp_path / 't.db'}", identities, 30, 5))
    public = history.key.public_key()
    assert proto.verify_records(log, public).ok
    forged = with_forged_chain(log[0])
    assert proto.record_hash(forged) == log[0]["hash"]  # the hash covers only the record's own calls
    result = proto.verify_records([forged], public)
    assert not result.ok, "a made-up call in a served record of form 2 verified"


def test_a_stored_call_claiming_a_segment_the_chain_does_not_have_fails_online_verification(
        identities: Identities, tmp_path: Path) -> None:  # noqa: F811
    """A store holder marks an unsealed report of another agent as sealed in segment 99 of the record's chain:
    the record as served now lists it; the online verification must say so, as the offline one does."""
    url = f"sqlite:///{tmp_path / 't.db'}"
    history, log = asyncio.run(sealed_then_more(url, identities, 30, 5))
    link = log[0]["segments"][0]["link"]
    db = sqlite3.connect(tmp_path / "t.db")
    db.execute("UPDATE reports SET seg = 99, link = ?, started = 0, "
               "entry = COALESCE(entry, '{\"call_id\":\"planted\"}') "
               "WHERE call_id = (SELECT MIN(call_id) FROM reports WHERE seg IS NULL)", (link,))
    assert db.total_changes == 1
    db.commit()
    db.close()

    async def read() -> tuple[Doc, Any]:
        store = open_store_url(url)
        await store.open()
        try:
            plane = History(store, identities, ["p"]).plane
            served = await plane.records.record(log[0]["record_id"])
            return served, await plane.records.verify(history.key.public_key())
        finally:
            await store.close()

    served, online = asyncio.run(read())
    assert len(served["calls"]) == len(log[0]["calls"]) + 1  # the planted call is served
    assert not proto.verify_records([served], history.key.public_key()).ok  # offline: caught (hash)
    assert not online.ok, "online verification passed a record served with a call planted in the store"
