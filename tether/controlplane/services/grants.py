"""Links and who holds them: issuing root grants, registering and verifying chains, agent-id ownership,
revocation, and the views over the agent graph (the agent list and tree, the audit surface).

Every link is registered before it is used, so the graph of registered links is the control plane's
knowledge of every descendant; a revocation is stored, then published as a ``revoke`` event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tether.capability.budget import GrantError, read_grant
from tether.capability.catalog import TIERS, Catalog
from tether.capability.chain import (
    ChainInvalid,
    Link,
    Verifier,
    mint_root,
    parse_chain_unverified,
    split_chain,
)
from tether.capability.errors import BAD_REQUEST, CONFLICT, FORBIDDEN, NOT_FOUND, ApiError, ChainError, TetherError
from tether.capability.events import REVOKE

from .. import runs, telemetry
from ..auth import Caller, Operator
from ..graph import Graph, surface
from ..metrics import Metrics
from ..store import Doc, LinkConflict, Store
from . import kinds
from .events import EventService

ADMIN = "admin"


def principal_of(caller: Caller) -> str:
    """How a chain holder acting above others is named in what it did (``by``, ``requested_by``)."""
    return f"principal:{caller.agent}"


def chain_jtis(link: Doc) -> list[str]:
    return list(link.get("chain_jtis", [link["jti"]]))


class GrantService:
    def __init__(self, store: Store, signing_key: Ed25519PrivateKey, catalog: Catalog, verifier: Verifier,
                 metrics: Metrics, events: EventService, clock: Callable[[], float]) -> None:
        self.store = store
        self.signing_key = signing_key
        self.catalog = catalog
        self.verifier = verifier
        self.metrics = metrics
        self.events = events
        self.clock = clock

    async def revoked(self) -> set[str]:
        return set(await self.store.revocations())

    async def graph(self) -> Graph:
        return Graph(await self.store.all_links())

    # -- issuing and registering ---------------------------------------------------------------------------
    def caps(self, role: str | None, caps: dict[str, Any]) -> dict[str, Any]:
        """A role's presets overlaid with explicit grants, each a tier or {tier, calls, per_minute}
        (docs/contract.md section 10, Budgets); every name must be in the catalog."""
        out: dict[str, Any] = dict(self.catalog.role(role)) if role else {}
        for name, tier in caps.items():
            try:
                read_grant(tier, tiers=TIERS)
            except GrantError as exc:
                raise TetherError(f"capability {name}: {exc}", code=BAD_REQUEST, capability=name,
                                  field="caps") from None
            out[name] = tier
        self.catalog.require(out)
        return out

    async def issue(self, agent: str, subject: Ed25519PublicKey, caps: dict[str, Any], ttl_s: float,
                    depth: int, operator: Operator | None = None) -> Doc:
        compact = mint_root(self.signing_key, agent=agent, subject_key=subject, caps=caps, now=self.clock(),
                            ttl_s=ttl_s, depth=depth, catalog=self.catalog)
        docs, _, _ = await self.register_chain(compact, operator)
        self.metrics.inc("tether_grants_issued_total")
        return {"agent": agent, "jti": docs[0]["jti"], "link": compact, "chain": [compact],
                "issued_by": docs[0].get("registered_by")}

    async def register_chain(self, wire: str, operator: Operator | None = None) -> tuple[list[Doc], int, list[str]]:
        """Verify a chain and store each of its links; returns (link docs, how many were new, revoked jtis).

        A chain whose every link is already registered is answered even when it has since been revoked or
        has expired: its sidecar, restarted after a termination, must still deliver its spool and
        acknowledge (it never forwards: the answer says which links are revoked). Anything new is verified
        in full, against the revocations, and must respect agent-id ownership."""
        links = parse_chain_unverified(split_chain(wire))
        known = [await self.store.get_link(link.hash) for link in links]
        leaf = known[-1]
        if leaf is not None and leaf.get("chain_hashes") == [link.hash for link in links]:
            revoked = await self.store.revoked_among(list(leaf["chain_jtis"]))
            return [doc for doc in known if doc is not None], 0, sorted(revoked)
        verified = self.verifier.verify(wire, now=self.clock(), revoked=await self.revoked())
        for link, doc in zip(verified.links, known, strict=True):
            other = None if doc is not None else await self.store.link_by_jti(link.jti)
            # Checked before any agent id is claimed (the store checks again, atomically). The same link, stored
            # meanwhile by a concurrent registration of a chain that shares it, is no clash.
            if other is not None and other["hash"] != link.hash:
                raise _jti_taken(link.jti, other["hash"])
        await self._claim_agent_ids(verified.links, known)
        docs = _link_docs(verified.links, self.clock())
        if operator is not None:  # who registered it (a chain holder registering its own chain is the link itself)
            docs = [{**d, "registered_by": operator.attribution(d["registered_at"])} for d in docs]
        try:
            new = await self.store.put_links(docs)
        except LinkConflict as exc:  # answered, never a 200 for a link that was not stored
            raise _jti_taken(exc.jti, exc.registered) from None
        if new:
            self.metrics.inc("tether_links_registered_total", new)
        return docs, new, []

    async def _claim_agent_ids(self, links: Sequence[Link], known: list[Doc | None]) -> None:
        """An agent id belongs to the principal that first delegated it: the parent agent (the control plane
        for a root grant; see runs.owner_key for why the agent and not its key). A link for that id issued
        by anyone else is refused, in the same tree as in another; its owner may delegate it again (a
        respawn), and an admin's root grant takes it over. Ids are owned case-insensitively (``Honest`` is
        not free beside another principal's ``honest``: a lookalike in every list). Ownership is claimed
        atomically, so two principals racing for a new id cannot both win."""
        for index, link in enumerate(links):
            if known[index] is not None:
                continue
            issuer = runs.owner_key(None if index == 0 else links[index - 1].sub)
            while True:
                owner = await self.store.get_doc(kinds.OWNER, link.sub.lower())
                if owner is not None and owner["owner"] == issuer:
                    break
                if owner is not None and index > 0:
                    raise ChainInvalid(
                        "agent_id_taken",
                        f"link {index}: agent id {link.sub!r} belongs to another principal (the one that first "
                        "delegated it, or an id differing only in case); delegate under a different id", link=index)
                version = owner["version"] if owner is not None else 0
                claim = {"agent": link.sub, "owner": issuer, "since": self.clock(), "link": link.hash,
                         "version": version + 1}
                if await self.store.cas_doc(kinds.OWNER, link.sub.lower(), version, claim):
                    break

    async def record_owners(self) -> None:
        """Ids registered before ownership was recorded (an upgrade): each belongs to the issuer of its first
        link. Once, at start-up; racing replicas agree through the store's compare-and-set."""
        if await self.store.list_docs(kinds.OWNER):
            return
        graph = await self.graph()
        for link in sorted(graph.by_hash.values(), key=lambda d: (d.get("registered_at", 0), d["hash"])):
            parent = graph.by_hash.get(link.get("prf") or "")
            claim = {"agent": link["sub"], "owner": runs.owner_key(parent["sub"] if parent else None),
                     "since": link.get("registered_at", 0), "link": link["hash"], "version": 1}
            await self.store.cas_doc(kinds.OWNER, link["sub"].lower(), 0, claim)  # the first one wins

    async def verify(self, wire: str) -> Doc:
        try:
            verified = self.verifier.verify(wire, now=self.clock(), revoked=await self.revoked())
        except ChainError as exc:
            return {"valid": False, "error": exc.to_dict()}
        registered = await self.store.get_link(verified.leaf.hash) is not None
        return {"valid": True, "agent": verified.agent, "caps": dict(verified.leaf.claims["caps"]),
                "exp": verified.exp, "jtis": list(verified.jtis), "registered": registered}

    # -- revoking -------------------------------------------------------------------------------------------
    @staticmethod
    def ancestor_of(caller: Caller | None, link: Doc) -> str:
        """Authorize an admin (``caller`` None), or a principal that issued ``link`` or any of its ancestors;
        returns who acts."""
        if caller is None:
            return ADMIN
        if caller.link_hash in link.get("chain_hashes", [])[:-1]:
            return principal_of(caller)
        raise ApiError(403, FORBIDDEN,
                       f"{caller.agent} is not an ancestor of {link['sub']}'s link; only an issuer above it may act")

    async def revoke_link(self, link: Doc, by: str, reason: str, termination_id: str | None = None,
                          operator: Operator | None = None) -> Doc:
        now = self.clock()
        doc = {"jti": link["jti"], "agent": link["sub"], "by": operator.name if operator else by, "at": now,
               "reason": reason, "termination_id": termination_id,
               "operator": operator.attribution() if operator else None}
        if await self.store.revoke(link["jti"], doc):
            self.metrics.inc("tether_revocations_total")
            telemetry.revoked(doc, link)
            await self.events.publish(REVOKE, None, {"jti": link["jti"], "agent": link["sub"], "at": now})
            return doc
        return (await self.store.revocations()).get(link["jti"], doc)

    async def revoke(self, jti: str, caller: Caller | None, reason: str, operator: Operator | None = None) -> Doc:
        """Revoke one link (an admin, or a principal above it); says which agents it cut off."""
        link = await self.store.link_named(jti)  # a unique prefix of 8+ hex characters names the link too
        if link is None:
            raise ApiError(404, NOT_FOUND, f"no registered link has jti {jti} (nor one beginning with it)")
        by = self.ancestor_of(caller, link)
        # The revocation goes out first; who it cut off is read afterwards from the descendants index, at
        # a cost that grows with the subtree, never with the whole graph.
        doc = await self.revoke_link(link, by, reason, operator=operator if caller is None else None)
        below = sorted(set((await self.store.descendants(link["hash"])).values()))
        return {**doc, "agents_cut_off": [link["sub"], *below]}

    async def revoke_agent(self, agent: str, caller: Caller | None, reason: str,
                           operator: Operator | None = None) -> Doc:
        """Revoke every link ``agent`` holds (an admin), or every one of them a principal is above (``caller``:
        a chain holder; none below it is a 403, and a link it is not above stays as it was)."""
        links = (await self.graph()).links_of(agent)
        if not links:
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        if caller is not None:
            links = [link for link in links if caller.link_hash in link.get("chain_hashes", [])[:-1]]
            if not links:
                raise ApiError(403, FORBIDDEN, f"{caller.agent} is not an ancestor of any link {agent} holds; only "
                               "an issuer above a link may revoke it")
        by = self.ancestor_of(caller, links[0])
        return {"agent": agent, "revoked": [await self.revoke_link(link, by, reason,
                                                                   operator=operator if caller is None else None)
                                            for link in links]}

    # -- views ----------------------------------------------------------------------------------------------
    async def agents(self) -> Doc:
        """Every registered link with its status and sidecar runs, as a list and as the delegation tree."""
        graph = await self.graph()
        revocations = await self.store.revocations()
        runs_of: dict[str, list[Doc]] = {}
        for run in (await self.store.all_sidecars()).values():
            if run.get("link"):
                runs_of.setdefault(run["link"], []).append(run)
        now = self.clock()

        def node_doc(link: Doc) -> Doc:
            return _agent_view(link, graph.revoked_in_chain(link["hash"], revocations), revocations,
                               runs_of.get(link["hash"], []), now)

        def tree(node: Any) -> Doc:
            return {**node_doc(node.link), "children": [tree(c) for c in node.children]}

        return {"agents": [node_doc(link) for link in graph.by_hash.values()],
                "tree": [tree(root) for root in graph.forest()]}

    async def surface(self, agent: str | None) -> Doc:
        graph = await self.graph()
        if agent is not None and not graph.links_of(agent):
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        return surface(self.catalog, graph, await self.revoked(), self.clock(), agent)


def _agent_view(link: Doc, revoked_by: Any, revocations: dict[str, Doc], mine: list[Doc], now: float) -> Doc:
    mine = sorted(mine, key=lambda r: (r.get("started_at") or 0, r["run_id"]))
    latest = max(mine, key=lambda r: r.get("last_seen") or 0) if mine else None
    claims = link["claims"]
    status = "revoked" if revoked_by else ("expired" if claims["exp"] <= now else "active")
    return {
        "agent": link["sub"],
        "jti": link["jti"],
        "link": link["hash"],
        "issuer": link["iss"],
        "parent_link": link.get("prf"),
        "caps": claims["caps"],
        "depth": claims["dpth"],
        "exp": claims["exp"],
        "status": status,
        "revoked": revocations.get(link["jti"]),
        "revoked_via": revoked_by,
        "registered_by": link.get("registered_by"),
        "sidecar": runs.run_view(latest, now) if latest else None,
        "runs": [runs.run_view(r, now) for r in mine],
    }


def _link_docs(links: Sequence[Link], now: float) -> list[Doc]:
    """The stored form of a verified chain's links, each with the jtis and hashes of its chain so far."""
    docs: list[Doc] = []
    jtis: list[str] = []
    hashes: list[str] = []
    for link in links:
        jtis.append(link.jti)
        hashes.append(link.hash)
        docs.append({"hash": link.hash, "jti": link.jti, "iss": link.iss, "sub": link.sub, "prf": link.prf,
                     "compact": link.compact, "claims": dict(link.claims), "registered_at": now,
                     "chain_jtis": list(jtis), "chain_hashes": list(hashes)})
    return docs


def _jti_taken(jti: str, registered: str) -> ApiError:
    return ApiError(409, CONFLICT, f"jti {jti} already names another registered link ({registered}); a jti names "
                    "one link only: mint the link again", jti=jti)
