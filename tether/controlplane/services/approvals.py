"""Calls held for approval: the request a sidecar files, the view an approver reads, and the decision,
published as an ``approval`` event to the link that holds the call.

A pending approval past its expiry is shown ``expired`` (never stored so: the sidecar resolves the call
itself when its wait ends). ``cancelled`` is a termination's decision, never a person's.

Nobody can push a held call out of an approver's sight: pending approvals are capped per sidecar run and per
link (``tether.approval_queue_full`` past either), every listing can be paged to its end and says how many are
pending per agent, and each pending approval says whether its sidecar run reports the call ``held`` or
whether it was only ``filed`` (with the agent's key, no run holding such a call).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from tether.capability import protocol
from tether.capability.errors import (
    APPROVAL_QUEUE_FULL,
    CHAIN_EXPIRED,
    CHAIN_REVOKED,
    CONFLICT,
    FORBIDDEN,
    NOT_FOUND,
    TERMINATED,
    ApiError,
)
from tether.capability.events import APPROVAL, APPROVED, EXPIRED, FILED, HELD, PENDING

from ..auth import BOOTSTRAP, Caller
from ..metrics import Metrics
from ..store import Doc, Store
from . import kinds
from .events import EventService
from .grants import chain_jtis

MAX_WAIT_S = 24 * 3600
MAX_PENDING_PER_RUN = 32  # calls one sidecar run may have waiting for a person at once
MAX_PENDING_PER_LINK = 128  # and all runs of one link together (a key can name a new run per request)


class ApprovalService:
    def __init__(self, store: Store, metrics: Metrics, events: EventService, clock: Callable[[], float],
                 ttl_s: float) -> None:
        self.store = store
        self.metrics = metrics
        self.events = events
        self.clock = clock
        self.ttl_s = ttl_s
        # Separation of duties: a person may not approve a call of an agent whose chain they registered (issued
        # it, or registered a link of it): the hand that granted is not the hand that approves. The bootstrap
        # admin token is no one person, so it is not held to it. ``controlplane serve --allow-self-approval``.
        self.separation_of_duties = True

    async def request(self, caller: Caller, ask: protocol.ApprovalRequest) -> protocol.ApprovalFiled:
        """File a held call for a decision; the answer names the approval its decision will name. The held call
        is kept only whole (``HeldCall.cut``: 413 otherwise, nothing stored). A longer wait than a day is
        shortened to a day."""
        held = ask.request
        refusal = held.cut() if held is not None else None
        if refusal is not None:
            raise refusal
        link = caller.link
        ttl = min(self.ttl_s if ask.timeout_s is None else ask.timeout_s, MAX_WAIT_S)
        now = self.clock()
        await self._room_for(caller, now)
        approval_id = "apr-" + os.urandom(6).hex()
        chain = [await self.store.get_link(h) for h in link.get("chain_hashes", [link["hash"]])]
        doc = {
            "id": approval_id,
            "agent": caller.agent,
            "link": caller.link_hash,
            "run_id": caller.run,
            "call_id": ask.call_id, "capability": ask.capability, "method": ask.method, "url": ask.url,
            "summary": (ask.summary or "")[:500],
            # What the approver decides on: the exact request (redacted by the sidecar as captures are), its
            # hash, where the agent sits (agent ids from the root) and who may decide. The held call is stored
            # as its message writes it (body_truncated and body_streamed false, kept for readers of the older
            # shape).
            "request": held.to_doc() if held is not None else None,
            "call_hash": held.call_hash if held is not None else None,
            "chain": [c["sub"] if c else "?" for c in chain],
            "deciders": ["approver", "admin"],  # the roles that may decide (tether/controlplane/auth.py)
            "status": PENDING,
            "requested_at": now,
            "expires_at": now + ttl,
            "decided_at": None,
            "decided_by": None,
            "version": 1,
        }
        await self.store.put_doc(kinds.APPROVAL, approval_id, doc)
        self.metrics.inc("tether_approvals_requested_total")
        return protocol.ApprovalFiled(approval_id, PENDING, doc["expires_at"], ask.call_id, doc["call_hash"], now)

    async def _room_for(self, caller: Caller, now: float) -> None:
        """Refuse a new approval when the caller's run, or its link, already has its fill waiting."""
        pending = [d for d in await self.store.list_docs(kinds.APPROVAL)
                   if d["status"] == PENDING and d["expires_at"] > now and d.get("link") == caller.link_hash]
        of_run = sum(1 for d in pending if d.get("run_id") == caller.run)
        if of_run >= MAX_PENDING_PER_RUN or len(pending) >= MAX_PENDING_PER_LINK:
            which = (f"sidecar run {caller.run} has {of_run}" if of_run >= MAX_PENDING_PER_RUN
                     else f"{caller.agent}'s link has {len(pending)}")
            raise ApiError(429, APPROVAL_QUEUE_FULL, f"{which} calls waiting for approval, the most it may have "
                           f"(per run {MAX_PENDING_PER_RUN}, per link {MAX_PENDING_PER_LINK}); a decision or an "
                           "expiry makes room", pending=of_run, limit=MAX_PENDING_PER_RUN)

    def view(self, doc: Doc) -> Doc:
        if doc["status"] == PENDING and doc["expires_at"] <= self.clock():
            return {**doc, "status": EXPIRED}
        return doc

    async def _origins(self, docs: Iterable[Doc]) -> dict[str, str]:
        """Pending approval id -> ``held`` when its run's last heartbeat lists the call held, else ``filed``."""
        held: dict[str, set[str]] = {}
        out: dict[str, str] = {}
        for doc in docs:
            if doc["status"] != PENDING:
                continue
            run = doc.get("run_id")
            if run and run not in held:
                sidecar = await self.store.get_sidecar(run) or {}
                held[run] = {c.get("call_id") for c in sidecar.get("inflight") or []
                             if isinstance(c, dict) and c.get("phase") == "held"}
                if sidecar.get("link") != doc.get("link") or sidecar.get("final"):
                    held[run] = set()  # another link's run, or one that has stopped: it holds nothing of this
            out[doc["id"]] = HELD if run and doc["call_id"] in held[run] else FILED
        return out

    async def find(self, status: str | None, agent: str | None = None, origin: str | None = None,
                   offset: int = 0, limit: int | None = None) -> tuple[list[Doc], int]:
        """One page of approvals in the order an approver works through them (pending first; held calls before
        filed requests; newest first), and how many match in all. Without ``limit``, all of them."""
        docs = [self.view(d) for d in await self.store.list_docs(kinds.APPROVAL)]
        docs = [d for d in docs if status in (None, d["status"]) and agent in (None, d["agent"])]
        origins = await self._origins(docs)
        docs = [{**d, "origin": origins.get(d["id"])} for d in docs]
        if origin is not None:
            docs = [d for d in docs if d["origin"] == origin]
        docs.sort(key=lambda d: (d["status"] != PENDING, d["origin"] != HELD, -d["requested_at"]))
        return docs[offset:None if limit is None else offset + limit], len(docs)

    async def summary(self) -> dict[str, Any]:
        """How many approvals are pending, in all and per agent (held calls and filed requests apart): what a
        listing that shows one page at a time must never hide."""
        pending, _ = await self.find(PENDING)
        agents: dict[str, dict[str, int]] = {}
        for doc in pending:
            counts = agents.setdefault(doc["agent"], {"pending": 0, HELD: 0, FILED: 0})
            counts["pending"] += 1
            counts[doc["origin"]] += 1
        return {"pending": len(pending), "held": sum(a[HELD] for a in agents.values()),
                "filed": sum(a[FILED] for a in agents.values()), "agents": dict(sorted(agents.items())),
                "limits": {"per_run": MAX_PENDING_PER_RUN, "per_link": MAX_PENDING_PER_LINK}}

    async def get(self, approval_id: str, caller: Caller | None) -> Doc:
        """One approval: an admin's (``caller`` None), or a sidecar's own link's."""
        doc = await self.store.get_doc(kinds.APPROVAL, approval_id)
        if doc is not None and caller is not None and doc.get("link", caller.link_hash) != caller.link_hash:
            doc = None
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {approval_id}")
        doc = self.view(doc)
        return {**doc, "origin": (await self._origins([doc])).get(doc["id"])}

    async def decide(self, approval_id: str, decision: str, by: str, call_hash: str | None = None,
                     operator: Doc | None = None) -> Doc:
        """``by``: who decided (an operator's name, or a termination); ``operator``: the operator's attribution
        (name, how they signed in), kept with the decision."""
        doc = await self.store.get_doc(kinds.APPROVAL, approval_id)
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {approval_id}")
        view = self.view(doc)
        if view["status"] != PENDING:
            raise ApiError(409, CONFLICT, f"approval {approval_id} is already {view['status']}")
        if decision == APPROVED:
            await self._still_possible(doc)
            if self.separation_of_duties and by != BOOTSTRAP:
                await self._not_their_own(doc, by)
        if call_hash is not None and call_hash != doc.get("call_hash"):
            raise ApiError(409, CONFLICT, f"approval {approval_id} holds call {doc.get('call_hash')}, not {call_hash}: "
                           "look at the call again before deciding", call_hash=doc.get("call_hash"))
        new = {**doc, "status": decision, "decided_at": self.clock(), "decided_by": by, "operator": operator,
               "version": doc["version"] + 1}
        if not await self.store.cas_doc(kinds.APPROVAL, approval_id, doc["version"], new):
            raise ApiError(409, CONFLICT, f"approval {approval_id} was decided concurrently")
        decided = protocol.ApprovalDecision(approval_id, decision, doc.get("call_hash"), doc["call_id"], by)
        await self.events.publish(APPROVAL, doc.get("link") or doc["agent"], decided.to_doc())
        return new

    async def _not_their_own(self, approval: Doc, name: str) -> None:
        link = await self.store.get_link(approval["link"]) if approval.get("link") else None
        for link_hash in (link or {}).get("chain_hashes", []):
            registered = await self.store.get_link(link_hash)
            if ((registered or {}).get("registered_by") or {}).get("operator") == name:
                raise ApiError(403, FORBIDDEN, f"{name} registered a link of {approval['agent']}'s chain "
                               f"(jti {registered['jti']}), so may not approve its calls (separation of duties): "
                               "another approver decides", reason="separation_of_duties")

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
