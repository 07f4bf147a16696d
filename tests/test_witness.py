"""The witness: it cosigns a log's checkpoint only when it extends the last one it cosigned, keeps that across
a restart, and refuses a fork, a rewritten past, an unknown log and a checkpoint its log did not sign."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from tether.capability import keys
from tether.controlplane.merkle import Tree, leaf_hash
from tether.controlplane.notes import (
    COSIGNATURE_V1,
    Checkpoint,
    Verifier,
    parse_note,
    signed_checkpoint,
    verify_cosignature,
)
from tether.controlplane.witness import SIZE_TYPE, WitnessServer, WitnessState, add_checkpoint

ORIGIN = "tether.test/records"
LOG_KEY, WITNESS_KEY = keys.generate(), keys.generate()
LOGS = {ORIGIN: Verifier(ORIGIN, LOG_KEY.public_key())}
WITNESS = Verifier("witness.test", WITNESS_KEY.public_key(), COSIGNATURE_V1)


def tree(n: int, tag: str = "") -> Tree:
    return Tree([leaf_hash(f"record {i}{tag if i == n - 1 else ''}".encode()) for i in range(n)])


def request(old: int, t: Tree, size: int | None = None, key=LOG_KEY, origin: str = ORIGIN) -> str:
    size = t.size if size is None else size
    proof = t.consistency_proof(old, size) if 0 < old < size else []
    note = signed_checkpoint(Checkpoint(origin, size, t.root(size)), origin, key)
    return "".join(f"{line}\n" for line in [f"old {old}", *(base64.b64encode(h).decode() for h in proof)]) + "\n" + note


def test_the_witness_cosigns_only_consistent_successors() -> None:
    seen: dict = {}

    def add(body: str) -> tuple[int, str]:
        answer = add_checkpoint(body, LOGS, seen, "witness.test", WITNESS_KEY, 1_796_000_000)
        if answer.seen is not None:
            seen[ORIGIN] = answer.seen
        return answer.status, answer.body

    t = tree(9)
    status, line = add(request(0, t, 5))
    assert status == 200
    cosigned = parse_note(signed_checkpoint(Checkpoint(ORIGIN, 5, t.root(5)), ORIGIN, LOG_KEY) + line)
    assert verify_cosignature(cosigned, WITNESS) == 1_796_000_000

    assert add(request(3, t, 9)) == (409, "5\n")  # the client's idea of the old size is stale: told the size
    assert add(request(5, t, 9))[0] == 200
    assert add(request(9, t, 9))[0] == 200  # the same checkpoint again is cosigned again
    forked = tree(9, tag="forked")
    assert add(request(9, forked, 9)) == (409, "9\n")  # same size, another root: a fork
    rewritten = Tree([leaf_hash(b"rewritten"), *t.leaves[1:], leaf_hash(b"next")])
    assert add(request(9, rewritten, 10))[0] == 422  # its proof cannot reach our size-9 root
    assert add(request(9, t, 9, key=keys.generate()))[0] == 403
    assert add(request(0, t, 3, origin="other.log"))[0] == 404
    assert add("old x\n\n")[0] == 400 and add("nonsense")[0] == 400
    assert seen[ORIGIN].size == 9 and seen[ORIGIN].root == t.root()


def test_the_server_keeps_what_it_cosigned_across_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        t = tree(12)
        for expected in ((200, 0, 4), (200, 4, 12)):
            server = WitnessServer("witness.test", WITNESS_KEY, LOGS, WitnessState(tmp_path), lambda: 1_796_000_000)
            async with TestClient(TestServer(server.app())) as client:
                resp = await client.post("/add-checkpoint", data=request(expected[1], t, expected[2]))
                assert resp.status == expected[0], await resp.text()
        restarted = WitnessServer("witness.test", WITNESS_KEY, LOGS, WitnessState(tmp_path), lambda: 1_796_000_001)
        async with TestClient(TestServer(restarted.app())) as client:
            stale = await client.post("/add-checkpoint", data=request(4, t, 12))
            assert stale.status == 409 and await stale.text() == "12\n"
            assert stale.headers["Content-Type"].startswith(SIZE_TYPE)
            fork = await client.post("/add-checkpoint", data=request(12, tree(12, "fork")))
            assert fork.status == 409

    asyncio.run(scenario())
