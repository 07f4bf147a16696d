"""Calls held for approval: the request a sidecar files, the view an approver reads, and the decision,
published as an ``approval`` event to the link that holds the call.

A pending approval past its expiry is shown ``expired`` (never stored so: the sidecar resolves the call
itself when its wait ends). ``cancelled`` is a termination's decision, never a person's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from capability.errors import CHAIN_EXPIRED, CHAIN_REVOKED, CONFLICT, NOT_FOUND, TERMINATED, ApiError
from capability.events import APPROVAL, APPROVED, EXPIRED, PENDING

from ..auth import Caller
from ..metrics import Metrics
from ..store import Doc, Store
from .events import EventService
from .grants import chain_jtis

MAX_WAIT_S = 24 * 3600


class ApprovalService:
    def __init__(self, store: Store, metrics: Metrics, events: EventService, clock: Callable[[], float],
                 ttl_s: float) -> None:
        self.store = store
        self.metrics = metrics
        self.events = events
        self.clock = clock
        self.ttl_s = ttl_s

    async def request(self, caller: Caller, call: Doc, held: Doc | None, timeout_s: float | None) -> Doc:
        """File a held call (``call``: call_id, capability, method, url, summary) for a decision. A longer wait
        than a day is shortened to a day."""
        link = caller.link
        ttl = min(self.ttl_s if timeout_s is None else timeout_s, MAX_WAIT_S)
        now = self.clock()
        approval_id = "apr-" + os.urandom(6).hex()
        chain = [await self.store.get_link(h) for h in link.get("chain_hashes", [link["hash"]])]
        doc = {
            "id": approval_id,
            "agent": caller.agent,
            "link": caller.link_hash,
            "run_id": caller.run,
            **call,
            # What the approver decides on: the exact request (redacted by the sidecar as captures are), its
            # hash, where the agent sits (agent ids from the root) and who may decide.
            "request": held,
            "call_hash": held.get("call_hash") if held else None,
            "chain": [c["sub"] if c else "?" for c in chain],
            "deciders": ["approver", "admin"],  # the roles that may decide (controlplane/auth.py)
            "status": PENDING,
            "requested_at": now,
            "expires_at": now + ttl,
            "decided_at": None,
            "decided_by": None,
            "version": 1,
        }
        await self.store.put_doc("approval", approval_id, doc)
        self.metrics.inc("tether_approvals_requested_total")
        return doc

    def view(self, doc: Doc) -> Doc:
        if doc["status"] == PENDING and doc["expires_at"] <= self.clock():
            return {**doc, "status": EXPIRED}
        return doc

    async def find(self, status: str | None) -> list[Doc]:
        docs = [self.view(d) for d in await self.store.list_docs("approval")]
        return [d for d in docs if status in (None, d["status"])]

    async def get(self, approval_id: str, caller: Caller | None) -> Doc:
        """One approval: an admin's (``caller`` None), or a sidecar's own link's."""
        doc = await self.store.get_doc("approval", approval_id)
        if doc is not None and caller is not None and doc.get("link", caller.link_hash) != caller.link_hash:
            doc = None
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {approval_id}")
        return self.view(doc)

    async def decide(self, approval_id: str, decision: str, by: str, call_hash: str | None = None,
                     operator: Doc | None = None) -> Doc:
        """``by``: who decided (an operator's name, or a termination); ``operator``: the operator's attribution
        (name, how they signed in), kept with the decision."""
        doc = await self.store.get_doc("approval", approval_id)
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {approval_id}")
        view = self.view(doc)
        if view["status"] != PENDING:
            raise ApiError(409, CONFLICT, f"approval {approval_id} is already {view['status']}")
        if decision == APPROVED:
            await self._still_possible(doc)
        if call_hash is not None and call_hash != doc.get("call_hash"):
            raise ApiError(409, CONFLICT, f"approval {approval_id} holds call {doc.get('call_hash')}, not {call_hash}: "
                           "look at the call again before deciding", call_hash=doc.get("call_hash"))
        new = {**doc, "status": decision, "decided_at": self.clock(), "decided_by": by, "operator": operator,
               "version": doc["version"] + 1}
        if not await self.store.cas_doc("approval", approval_id, doc["version"], new):
            raise ApiError(409, CONFLICT, f"approval {approval_id} was decided concurrently")
        await self.events.publish(
            APPROVAL,
            doc.get("link") or doc["agent"],
            {"id": approval_id, "call_id": doc["call_id"], "status": decision, "decided_by": by,
             "call_hash": doc.get("call_hash")},
        )
        return new

    async def _still_possible(self, approval: Doc) -> None:
        """Approving a call that can no longer go would say "approved" while the sidecar refuses it: say so."""
        link = await self.store.get_link(approval["link"]) if approval.get("link") else None
        if link is None:
            return
        revoked = await self.store.revoked_among(chain_jtis(link))
        if revoked:
            raise ApiError(409, CHAIN_REVOKED, f"{approval['agent']}'s chain is revoked "
                           f"({', '.join(sorted(revoked))}): the held call can no longer be forwarded")
        if link["claims"]["exp"] <= self.clock():
            raise ApiError(409, CHAIN_EXPIRED, f"{approval['agent']}'s chain has expired: the held call "
                           "can no longer be forwarded")
        run = await self.store.get_sidecar(approval["run_id"]) if approval.get("run_id") else None
        if run is not None and run.get("final"):
            raise ApiError(409, TERMINATED, f"the sidecar run that holds this call is {run['final']}")
