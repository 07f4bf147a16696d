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

from .test_record_index import History, Identities, identities, redis_url  # noqa: F401  (fixtures)
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


# -- segments sealed before a key rotation, named by a record after it --------------------------------------------
async def sealed_across_a_rotation(url: str, ids: Identities, out: Path) -> tuple[Doc, Any]:
    """30 calls sealed under the old key; ``tether keys rotate``'s record appended; the record written under the
    new key. Writes the served record, its inclusion proof and a checkpoint, and the new public key, to ``out``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tether.capability import keys
    from tether.capability.catalog import parse_catalog
    from tether.controlplane.app import ControlPlane
    from tether.controlplane.rotation import cross_sign, rotation_record
    from tether.controlplane.services import kinds
    from tether.controlplane.services import terminations as service

    from .harness import ADMIN_TOKEN
    from .test_segments import SealingHistory

    store = open_store_url(url)
    await store.open()
    try:
        history = SealingHistory(store, ids, ["p"], min_calls=1)
        history.sealer.max_calls = 7
        await history.setup()
        for _ in range(30):
            await history.step("call", "c", 0)
        await history.step("seal", "p", 0)
        old, new = history.key, Ed25519PrivateKey.generate()
        heads = await store.record_heads()
        rotation = rotation_record(record_id="rec-rotation", prev_hash=heads[-1]["hash"] if heads else "", old=old,
                                   new=new, by="test", reason="test", now=history.tick())
        assert await store.append_record(proto.seal(cross_sign(rotation, new), old))
        catalog = parse_catalog(ids.proc.catalog_path.read_text(), str(ids.proc.catalog_path))
        plane = ControlPlane(store, new, catalog, ADMIN_TOKEN, clock=lambda: history.now, replica="me")
        doc = await store.get_doc(kinds.TERMINATION, "term-p")
        assert doc is not None and await store.try_lease("termination:term-p", "me", service.LEASE_S, history.tick())
        record_id, _ = await plane.terminations.write_record(doc)
        served = await plane.records.record(record_id)
        assert "segments" in served and served["sealed"][0]["key_id"] == proto.key_id_of(old)
        (out / "record.json").write_text(json.dumps(served))
        (out / "proof.json").write_text(json.dumps(await plane.checkpoints.inclusion(record_id, None)))
        (out / "checkpoint").write_text(await plane.checkpoints.checkpoint())
        (out / "new.pub").write_bytes(keys.public_pem(new.public_key()))
        log = [await plane.records.record(h["record_id"]) for h in await store.record_heads()]
        return served, (proto.verify_records(log, new.public_key()), await plane.records.verify(new.public_key()))
    finally:
        await store.close()


def test_verify_one_accepts_a_record_whose_segments_were_sealed_before_a_key_rotation(
        identities: Identities, tmp_path: Path) -> None:  # noqa: F811
    import os
    import subprocess
    import sys

    served, (offline, online) = asyncio.run(
        sealed_across_a_rotation(f"sqlite:///{tmp_path / 't.db'}", identities, tmp_path))
    assert offline.ok and online.ok, (offline.problems, online.problems)  # the whole log follows the rotation
    one = subprocess.run([sys.executable, "-m", "tether", "records", "verify-one", str(tmp_path / "record.json"),
                          "--proof", str(tmp_path / "proof.json"), "--checkpoint", str(tmp_path / "checkpoint"),
                          "--trust", str(tmp_path / "new.pub")], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ})
    assert one.returncode == 0, one.stdout + one.stderr
    edited = json.loads(json.dumps(served))
    edited["calls"][0]["status"] = 500  # still caught: the head the record names pins every segment
    (tmp_path / "record.json").write_text(json.dumps(edited))
    bad = subprocess.run([sys.executable, "-m", "tether", "records", "verify-one", str(tmp_path / "record.json"),
                          "--proof", str(tmp_path / "proof.json"), "--checkpoint", str(tmp_path / "checkpoint"),
                          "--trust", str(tmp_path / "new.pub")], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ})
    assert bad.returncode == 1 and "segment 1 of link" in bad.stdout, bad.stdout + bad.stderr


async def sealed_by_a_stale_replica(url: str, ids: Identities) -> tuple[int, int]:
    """A replica still running on the old key after ``tether keys rotate``: its sealer must seal nothing (as its
    termination service writes nothing); a replica on the new key seals the same calls."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tether.controlplane.rotation import cross_sign, rotation_record
    from tether.controlplane.services.segments import SegmentService

    from .test_segments import SealingHistory

    store = open_store_url(url)
    await store.open()
    try:
        history = SealingHistory(store, ids, ["p"], min_calls=1)
        await history.setup()
        for _ in range(10):
            await history.step("call", "c", 0)
        old, new = history.key, Ed25519PrivateKey.generate()
        rotation = rotation_record(record_id="rec-rotation", prev_hash="", old=old, new=new, by="test",
                                   reason="test", now=history.tick())
        assert await store.append_record(proto.seal(cross_sign(rotation, new), old))
        history.tick()
        stale = await SegmentService(store, old, lambda: history.now, settle_s=0.0, min_calls=1).seal_once()
        fresh = await SegmentService(store, new, lambda: history.now, settle_s=0.0, min_calls=1).seal_once()
        return stale, fresh
    finally:
        await store.close()


def test_a_replica_left_on_the_old_key_after_a_rotation_seals_nothing(identities: Identities,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    stale, fresh = asyncio.run(sealed_by_a_stale_replica(f"sqlite:///{tmp_path / 't.db'}", identities))
    assert (stale, fresh) == (0, 10)


def test_a_malformed_served_record_of_form_2_is_a_problem_named_not_a_crash(tmp_path: Path) -> None:
    """``tether records verify --file`` of a log whose form-2 record has a malformed ``calls_from``, ``sealed`` or
    ``segments``: exit 1 naming the record, as for any malformed record (it crashed with a traceback)."""
    import os
    import subprocess
    import sys

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tether.capability import keys

    key = Ed25519PrivateKey.generate()
    (tmp_path / "k.pub").write_bytes(keys.public_pem(key.public_key()))
    base = {"record_id": "r", "prev_hash": "", "segments": [{"link": "l"}], "calls": [{"call_id": "a"}],
            "calls_from": [[0, 1]], "sealed": [{}]}
    for n, bad in enumerate(({"calls_from": "x"}, {"sealed": [1]}, {"calls_from": [[0, "a"]]}, {"segments": [3]},
                             {"calls": "x"})):
        path = tmp_path / f"bad{n}.json"
        path.write_text(json.dumps([{**base, **bad}]))
        out = subprocess.run([sys.executable, "-m", "tether", "records", "verify", "--file", str(path), "--trust",
                              str(tmp_path / "k.pub")], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[1], env={**os.environ})
        assert out.returncode == 1 and "Traceback" not in out.stderr, (bad, out.stdout, out.stderr)
        assert "record 0 (r)" in out.stdout, (bad, out.stdout)


def test_a_closed_chain_keeps_no_loose_count_on_redis(identities: Identities, redis_url: str) -> None:  # noqa: F811
    """The sealer reads every link's count of loose reports each pass (``sealable_links``: an HGETALL); a chain
    a record closed is never sealed again, so it must not stay in that hash (nor come back with a late report),
    or the hash, and every pass, grows with every link the store ever had."""
    import redis

    from .test_record_index import flushed

    flushed(redis_url)

    async def run() -> tuple[Doc, str]:
        store = open_store_url(redis_url)
        await store.open()
        try:
            from .test_segments import SealingHistory

            history = SealingHistory(store, identities, ["p"], min_calls=1)
            await history.setup()
            for _ in range(5):
                await history.step("call", "c", 0)
            await history.step("write", "p", 0)
            await history.step("call", "c", 0)  # after the record: its chain is closed
            return (await store.chains([identities.links["c"]]))[identities.links["c"]], identities.links["c"]
        finally:
            await store.close()

    chain, link = asyncio.run(run())
    assert chain["closed_by"] is not None
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert client.hget("tether:0:chains:loose", link) is None
    finally:
        client.close()
