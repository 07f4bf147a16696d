"""The delegation graph, computed from registered links: trees, ancestry, subtrees, effective surface.

Pure functions over link documents (as the store keeps them) and the revoked-jti set.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from tether.capability.catalog import Catalog

from . import audit

Doc = dict[str, Any]


@dataclass
class Node:
    link: Doc
    children: list[Node] = field(default_factory=list)

    @property
    def agent(self) -> str:
        return self.link["sub"]


class Graph:
    def __init__(self, links: Iterable[Doc]) -> None:
        self.by_hash: dict[str, Doc] = {}
        self.children: dict[str, list[str]] = {}
        for link in links:
            self.by_hash[link["hash"]] = link
        for h, link in self.by_hash.items():
            prf = link.get("prf")
            if prf:
                self.children.setdefault(prf, []).append(h)

    def ancestors(self, link_hash: str) -> list[Doc]:
        """Strict ancestors of a link, parent first, root last."""
        out: list[Doc] = []
        seen: set[str] = {link_hash}
        current = self.by_hash.get(link_hash)
        while current is not None and current.get("prf"):
            parent_hash = current["prf"]
            if parent_hash in seen:
                break
            seen.add(parent_hash)
            current = self.by_hash.get(parent_hash)
            if current is not None:
                out.append(current)
        return out

    def chain(self, link_hash: str) -> list[Doc]:
        """The link and its ancestors, root first."""
        link = self.by_hash.get(link_hash)
        if link is None:
            return []
        return [*reversed(self.ancestors(link_hash)), link]

    def descendants(self, link_hash: str) -> list[Doc]:
        out: list[Doc] = []
        stack = list(self.children.get(link_hash, []))
        seen: set[str] = set()
        while stack:
            h = stack.pop()
            if h in seen:
                continue
            seen.add(h)
            out.append(self.by_hash[h])
            stack.extend(self.children.get(h, []))
        return out

    def links_of(self, agent: str) -> list[Doc]:
        return [link for link in self.by_hash.values() if link["sub"] == agent]

    def agents(self) -> list[str]:
        return sorted({link["sub"] for link in self.by_hash.values()})

    def subtree(self, agent: str) -> list[Doc]:
        """Every link held by ``agent`` or by any agent below it: what terminating ``agent`` must revoke."""
        out: dict[str, Doc] = {}
        for link in self.links_of(agent):
            out[link["hash"]] = link
            for d in self.descendants(link["hash"]):
                out[d["hash"]] = d
        return list(out.values())

    def revoked_in_chain(self, link_hash: str, revoked: Container[str]) -> str | None:
        for link in self.chain(link_hash):
            if link["jti"] in revoked:
                return link["jti"]
        return None

    def forest(self) -> list[Node]:
        nodes = {h: Node(link) for h, link in self.by_hash.items()}
        roots: list[Node] = []
        for _h, node in nodes.items():
            prf = node.link.get("prf")
            if prf and prf in nodes:
                nodes[prf].children.append(node)
            else:
                roots.append(node)
        for node in nodes.values():
            node.children.sort(key=lambda n: (n.link.get("registered_at", 0), n.agent))
        roots.sort(key=lambda n: (n.link.get("registered_at", 0), n.agent))
        return roots

    def is_live(self, link_hash: str, revoked: Container[str], now: float) -> bool:
        chain = self.chain(link_hash)
        return bool(chain) and all(
            link["jti"] not in revoked and link["claims"]["nbf"] <= now < link["claims"]["exp"] for link in chain
        )


def surface(
    catalog: Catalog, graph: Graph, revoked: Container[str], now: float, agent: str | None = None
) -> dict[str, Any]:
    """The audit surface (version 2, see ``audit.surface``) from every agent's live links."""
    agents = [agent] if agent is not None else graph.agents()
    grants = {
        name: [link["claims"]["caps"] for link in graph.links_of(name) if graph.is_live(link["hash"], revoked, now)]
        for name in agents
    }
    return audit.surface(catalog, grants)
