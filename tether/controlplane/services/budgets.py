"""The control plane's side of budgets (docs/contract.md section 10): it is the one owner of every budget.

A sidecar leases a *slice* of a capability's calls (``POST /v1/budgets/slices``): the control plane finds
every budgeted link of the sidecar's registered chain for that capability and takes the slice from all of
their counters at once, all or nothing (``Store.take_slice``: a transaction in SQLite, a Lua script in
Redis), so any replica may answer and a restart loses no count. The sidecar spends it without a round trip
per call and returns what it did not use (``POST /v1/budgets/slices/return``). A slice whose run stopped
without returning it, or whose lease lapsed, is settled as fully spent by a sweep on every replica (fail
closed: a sidecar that died with a slice may have spent all of it). A live run's heartbeat names the slices it
holds (``Heartbeat.budget_slices``); the sweep returns whole an open slice of that run which the run gave up on
(asked for at or before the beat and not held: a replica crashed with its answer), by :func:`given_up`.
``GET /v1/budgets/{jti}`` shows a link's subtree with granted, used and leased per budgeted capability. No HTTP
here: ``routes/budgets.py`` answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from tether.capability.budget import (
    DEFAULT_WINDOW_S,
    MAX_SLICE,
    SLICE_FRACTION,
    calls_key,
    read_grant,
    slice_keys,
    window_of,
)
from tether.capability.errors import BUDGET_EXHAUSTED, CHAIN_REVOKED, FORBIDDEN, NOT_FOUND, RATE_LIMITED, ApiError
from tether.capability.protocol import MAX_SLICE_SEQ as MAX_SEQ  # noqa: F401  (its number, read by the tests)
from tether.capability.protocol import HeldSlices, Settled, Settlement, SliceLease, SliceRefusal, SliceRequest

from .. import runs
from ..auth import Caller
from ..body import bad
from ..graph import Graph, Node
from ..metrics import Metrics
from ..store import Doc, Store, StoreUnavailable
from .grants import GrantService

log = logging.getLogger("tether.budgets")
SWEEP_INTERVAL_S = 1.0
MAX_SETTLE = 10_000


def given_up(slice_doc: Doc, held: HeldSlices | None) -> bool:
    """Whether an open slice is one its (live) run will never spend, by what the run's last heartbeat held:
    asked for at or before the beat was built (``seq <= asked``) and not among the slices the run held, was
    still asking for, or was settling then. The sidecar names a request as asked and as asking in one step,
    holds a slice from its answer until its settlement is acknowledged, and never takes an answer after it
    stopped asking, so such a slice is never spent: returning it whole double-spends nothing. A slice asked
    for after the beat (its answer perhaps still on its way) has a greater ``seq`` and is kept, however late
    the beat is read; so is one without a ``seq`` (a sidecar that numbers none) and every slice of a run whose
    heartbeat names none (fail closed: those count as leased until the run stops)."""
    seq, slice_id, run = slice_doc.get("seq"), slice_doc.get("id"), slice_doc.get("run")
    if held is None or isinstance(seq, bool) or not isinstance(seq, int):
        return False
    if not isinstance(slice_id, str) or not isinstance(run, str) or not slice_id.startswith(f"{run}/"):
        return False  # not a slice as take() names them: nothing to compare the tags with
    return seq <= held.asked and slice_id[len(run) + 1:] not in held.held


def held_by(run: Doc | None) -> HeldSlices | None:
    """A run document's last word on the slices it holds; None when it said none (or nothing readable)."""
    value = (run or {}).get("budget_slices")
    if value is None:
        return None
    try:
        return HeldSlices.read(value)
    except ApiError:
        return None


def window_from_env(default: float = DEFAULT_WINDOW_S) -> float:
    value = os.environ.get("TETHER_RATE_WINDOW_S")
    return float(value) if value else default


async def budget_use(store: Store, links: list[Doc], now: float, window_s: float = DEFAULT_WINDOW_S) -> dict[str, Doc]:
    """jti -> {capability: {tier, granted, used, leased, left[, per_minute, window_used, window_leased]}} for
    every link that budgets something; what a reconciliation record and ``tether budgets`` show."""
    wanted: dict[str, list[tuple[str, str, Any]]] = {}
    counters: list[str] = []
    index, _ = window_of(now, window_s)
    for link in links:
        for cap, value in link["claims"]["caps"].items():
            if isinstance(value, str):
                continue
            grant = read_grant(value)
            if not grant.budgeted:
                continue
            wanted.setdefault(link["jti"], []).append((cap, link["jti"], grant))
            counters += [calls_key(link["jti"], cap), f"{calls_key(link['jti'], cap)}/w{index}"]
    counts = await store.budget_counts(counters) if counters else {}
    out: dict[str, Doc] = {}
    for jti, items in wanted.items():
        caps: Doc = {}
        for cap, _, grant in items:
            used, leased = counts[calls_key(jti, cap)]
            entry: Doc = {"tier": grant.tier, "granted": grant.calls, "used": used, "leased": leased,
                          "left": None if grant.calls is None else max(0, grant.calls - used - leased)}
            if grant.per_minute is not None:
                w_used, w_leased = counts[f"{calls_key(jti, cap)}/w{index}"]
                entry.update(per_minute=grant.per_minute, window_s=window_s, window_used=w_used,
                             window_leased=w_leased)
            caps[cap] = entry
        out[jti] = caps
    return out


class BudgetService:
    """Slices taken and settled, budget trees shown, and the sweep of slices nobody will return."""

    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float], grants: GrantService,
                 lease_ttl_s: float, window_s: float | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.grants = grants
        self.lease_ttl_s = lease_ttl_s
        self.window_s = window_s or window_from_env()

    # -- slices ---------------------------------------------------------------------------------------
    async def take(self, who: Caller, ask: SliceRequest) -> SliceLease:
        """Lease up to ``ask.want`` calls of ``ask.capability`` for ``who``'s run from every budgeted link of its
        chain: the slice, or no slice (``calls`` 0) and why when a budget is spent. ``ask.seq`` numbers the run's
        slice requests in order (its heartbeat names the last one: see :func:`given_up`)."""
        capability = ask.capability
        await self.settle(who, ask.settle)  # used-up slices, piggybacked on the next take
        chain = await self._live_chain(who)
        if capability not in who.link["claims"]["caps"]:
            raise bad(f"{capability} is not granted to {who.agent}", capability=capability)
        now = self.clock()
        counters = slice_keys([(doc["jti"], doc["claims"]["caps"]) for doc in chain], capability, now, self.window_s)
        if not counters:
            raise bad(f"no link of {who.agent}'s chain budgets {capability}; its calls are not counted",
                      capability=capability)
        _, window_end = window_of(now, self.window_s)
        rated = any(c.kind == "per_minute" for c in counters)
        slice_id = f"{who.run}/{ask.slice}"  # the run owns its slices: only it may return them
        doc = {"id": slice_id, "run": who.run, "agent": who.agent, "link": who.link_hash,
               "capability": capability, "taken_at": now, "window_end": window_end if rated else None}
        if ask.seq is not None:
            doc["seq"] = ask.seq
        ttl = 2 * self.window_s + 3600 if rated else 0  # rate-window counters are forgotten after a while
        granted, worst = await self.store.take_slice(
            doc, [(c.key, c.limit) for c in counters], min(ask.want, MAX_SLICE), SLICE_FRACTION, ttl)
        if granted <= 0:
            tight = counters[worst or 0]
            holder = next((d["sub"] for d in chain if d["jti"] == tight.jti), "?")
            return self._refusal(capability, tight, holder, window_end - now)
        self.metrics.inc("tether_budget_slices_total")
        return SliceLease(slice_id, granted, round(window_end - now, 3) if rated else None)

    async def _live_chain(self, who: Caller) -> list[Doc]:
        link = who.link
        revoked = await self.store.revoked_among(list(link.get("chain_jtis", [])))
        if revoked:
            raise ApiError(403, CHAIN_REVOKED, f"the chain is revoked ({', '.join(sorted(revoked))}); no slice")
        chain = [await self.store.get_link(h) for h in link.get("chain_hashes", [link["hash"]])]
        if any(doc is None for doc in chain):
            raise ApiError(403, CHAIN_REVOKED, "a link of the chain is not registered; no slice")
        return [doc for doc in chain if doc is not None]

    def _refusal(self, capability: str, tight: Any, holder: str, window_left: float) -> SliceLease:
        """No slice is an answer, not an error of this API: the refusal the sidecar will give its calls (the
        calls themselves are refused 429 by the sidecar)."""
        self.metrics.inc(f'tether_budget_refusals_total{{kind="{tight.kind}"}}')
        if tight.kind == "per_minute":
            retry = max(0.0, window_left)
            error = SliceRefusal(RATE_LIMITED, f"{capability}: {holder}'s per_minute={tight.limit} is used up in "
                                 f"this {self.window_s:g}s window; retry in {retry:.1f}s", round(retry, 3),
                                 capability, tight.jti)
        else:
            error = SliceRefusal(BUDGET_EXHAUSTED, f"{capability}: {holder}'s calls={tight.limit} budget is spent "
                                 "(it is shared with every delegate below it); ask its issuer for a new grant",
                                 None, capability, tight.jti)
        return SliceLease(None, 0, None, error)

    async def settle(self, who: Caller, items: list[Settlement]) -> list[Settled]:
        """Settle ``who``'s run's slices: what each did not use goes back to every counter."""
        settled = []
        for item in items[:MAX_SETTLE]:
            if not item.slice.startswith(f"{who.run}/"):
                raise ApiError(403, FORBIDDEN, f"slice {item.slice[:80]!r} is not this run's")
            doc = await self.store.settle_slice(item.slice, item.used, self.clock())
            if doc is not None:
                settled.append(Settled(doc["id"], doc["used"], doc["n"] - doc["used"]))
        return settled

    # -- views ------------------------------------------------------------------------------------------
    async def link_view(self, jti: str, principal: Caller | None) -> Doc:
        """A link's subtree, for an admin (``principal`` None) or a principal above the link."""
        link = await self.store.link_named(jti)  # a unique prefix names the link too
        if link is None:
            raise ApiError(404, NOT_FOUND, f"no registered link has jti {jti[:80]!r} (nor one beginning with it)")
        self.grants.ancestor_of(principal, link)
        return await self.tree(await self.grants.graph(), [link["hash"]])

    async def fleet_view(self, agent: str | None) -> Doc:
        """Every root's tree, or ``agent``'s own links (not those below another link of it already shown)."""
        graph = await self.grants.graph()
        if agent:
            held = {link["hash"] for link in graph.links_of(agent)}
            tops = [h for h in held if not any(a["hash"] in held for a in graph.ancestors(h))]
            if not tops:
                raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        else:
            tops = [node.link["hash"] for node in graph.forest()]
        return await self.tree(graph, sorted(tops))

    async def tree(self, graph: Graph, tops: list[str]) -> Doc:
        now = self.clock()
        links = {h: graph.by_hash[h] for top in tops for h in [top, *(d["hash"] for d in graph.descendants(top))]}
        use = await budget_use(self.store, list(links.values()), now, self.window_s)
        revoked = await self.store.revoked_among([link["jti"] for link in links.values()])
        nodes = {node.link["hash"]: node for node in _walk(graph.forest())}

        def view(link_hash: str) -> Doc:
            link = graph.by_hash[link_hash]
            node = nodes.get(link_hash)
            return {"agent": link["sub"], "jti": link["jti"], "link": link_hash, "revoked": link["jti"] in revoked,
                    "budgets": use.get(link["jti"], {}),
                    "children": [view(c.link["hash"]) for c in (node.children if node else [])]}

        return {"window_s": self.window_s, "now": now, "links": [view(h) for h in tops]}

    # -- the sweep: slices nobody will return -------------------------------------------------------------
    async def sweep_once(self) -> int:
        """Settle as spent every open slice whose run said it stopped (without returning it) or whose lease
        lapsed: such a sidecar may have spent all of it. Return whole every open slice its live run gave up
        on (:func:`given_up`). Any replica may run it; a slice is settled once, whichever settles it first."""
        now = self.clock()
        grace = max(1.0, self.lease_ttl_s / 3)
        settled = 0
        cache: dict[str, Doc | None] = {}
        for doc in await self.store.open_slices():
            run_id = doc.get("run") or ""
            if run_id not in cache:
                cache[run_id] = await self.store.get_sidecar(run_id)
            run = cache[run_id]
            if run is None:
                gone = now > doc.get("taken_at", 0) + self.lease_ttl_s + grace
            else:
                gone = run.get("final") in runs.FINAL_STATES or (run.get("lease_expires") or 0) + grace < now
            if gone and await self.store.settle_slice(doc["id"], int(doc["n"]), now) is not None:
                settled += 1
                log.warning("slice %s of run %s (%s, %d calls) was never returned; counted as spent",
                            doc["id"], run_id, doc.get("capability"), doc["n"])
            elif not gone and given_up(doc, held_by(run)) and await self.store.settle_slice(doc["id"], 0, now):
                settled += 1
                self.metrics.inc("tether_budget_slices_given_up_total")
                log.warning("slice %s of run %s (%s, %d calls) never reached it (its heartbeat does not hold "
                            "it); returned to the budget", doc["id"], run_id, doc.get("capability"), doc["n"])
        return settled

    async def run(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except StoreUnavailable:
                pass  # the store is down: nothing can be taken either; sweep when it is back
            except Exception:  # the sweep must outlive one bad document
                log.exception("budget sweep failed; retrying")
            await asyncio.sleep(SWEEP_INTERVAL_S)


def _walk(nodes: list[Node]) -> list[Node]:
    out: list[Node] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out
