"""Routes over the record log as a Merkle tree: its signed checkpoint, and the proofs a verifier asks for."""

from __future__ import annotations

from aiohttp import web

from tether.capability.errors import BAD_REQUEST, NOT_FOUND, ApiError

from .. import schemas as sc
from ..merkle import ProofError
from ..services.checkpoints import CheckpointService
from . import ADMIN, NONE, Route

INCLUSION = sc.obj({"record_id": sc.STR, "record_hash": sc.STR, "index": sc.NUM, "size": sc.NUM, "root": sc.STR,
                    "proof": sc.STRINGS}, "record_id", "record_hash", "index", "size", "root", "proof")
CONSISTENCY = sc.obj({"first": sc.NUM, "second": sc.NUM, "proof": sc.STRINGS}, "first", "second", "proof")


def _size(request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise ApiError(400, BAD_REQUEST, f"{name} must be a record count (a whole number)", field=name)
    return int(value)


class CheckpointRoutes:
    def __init__(self, checkpoints: CheckpointService) -> None:
        self.checkpoints = checkpoints

    async def h_checkpoint(self, request: web.Request) -> web.Response:
        return web.Response(text=await self.checkpoints.checkpoint(), content_type="text/plain", charset="utf-8")

    async def h_inclusion(self, request: web.Request) -> web.Response:
        record = request.query.get("record", "")
        if not record:
            raise ApiError(400, BAD_REQUEST, "record=ID is required", field="record")
        try:
            return web.json_response(await self.checkpoints.inclusion(record, _size(request, "size")))
        except ProofError as exc:
            raise ApiError(404, NOT_FOUND, str(exc)) from None

    async def h_consistency(self, request: web.Request) -> web.Response:
        first = _size(request, "first")
        if first is None:
            raise ApiError(400, BAD_REQUEST, "first=SIZE is required", field="first")
        try:
            return web.json_response(await self.checkpoints.consistency(first, _size(request, "second")))
        except ProofError as exc:
            raise ApiError(404, NOT_FOUND, str(exc)) from None

    def table(self) -> list[Route]:
        return [
            Route("GET", "/v1/records/checkpoint", self.h_checkpoint, "The record log's latest signed checkpoint "
                  "(C2SP signed note: origin, size, root)", NONE, "records", content="text/plain",
                  ok={"type": "string"}),
            Route("GET", "/v1/records/proof/inclusion", self.h_inclusion, "A record's inclusion proof in the log "
                  "of a size", ADMIN, "records", ok=INCLUSION,
                  query=(("record", sc.STR, "a record or termination id"),
                         ("size", sc.STR, "the log size the proof is for (default: now)"))),
            Route("GET", "/v1/records/proof/consistency", self.h_consistency, "That the log of size first is a "
                  "prefix of the log of size second", ADMIN, "records", ok=CONSISTENCY,
                  query=(("first", sc.STR, "the older size"), ("second", sc.STR, "the newer size (default: now)"))),
        ]
