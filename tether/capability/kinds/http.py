"""The ``http`` kind: calls matched by host, port, methods and a path glob (``catalog.HttpMatch``).

On the audit surface its wire is ``{host, port, methods, path}``; a new wire widens when its host differs, its
port is lifted or changed, it adds a method, or its path glob admits a path the old one refused (decided by
language inclusion, ``capability.glob``, with a shortest witness while the search budget lasts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..catalog import HttpMatch, host_key, parse_http
from ..credentials import Route
from ..glob import Budget, GlobTooLong, compare

NAME = "http"
# What widened, as `tether audit diff --json` names it.
HOST, PORT, METHODS, PATH = "host_changed", "port_widened", "methods_added", "path_widened"

Change = tuple[str, Any, Any, str]


class HttpKind:
    name = NAME

    def parse(self, source: str, where: str, raw: Any) -> HttpMatch:
        return parse_http(source, where, raw)

    def to_dict(self, match: HttpMatch) -> dict[str, Any]:
        return match.to_dict()

    def route(self, match: HttpMatch) -> Route | None:
        """Fixed only when the catalog names both the scheme and the port."""
        return Route(match.scheme, match.host, match.port) if match.scheme is not None and match.port is not None \
            else None

    def wire(self, match: HttpMatch) -> dict[str, Any]:
        return {"host": match.host, "port": match.port, "methods": list(match.methods), "path": match.path}

    def wire_ok(self, value: Any) -> bool:
        if not isinstance(value, Mapping):
            return False
        port = value.get("port")
        return (isinstance(value.get("host"), str) and isinstance(value.get("path"), str)
                and isinstance(value.get("methods"), list) and all(isinstance(m, str) for m in value["methods"])
                and (port is None or (isinstance(port, int) and not isinstance(port, bool))))

    def widenings(self, old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[Change]:
        out: list[Change] = []
        if host_key(old["host"]) != host_key(new["host"]):
            out.append((HOST, old["host"], new["host"], ""))
        if old.get("port") is not None and new.get("port") != old.get("port"):
            out.append((PORT, old["port"], new.get("port"), ""))
        added = sorted(set(new["methods"]) - set(old["methods"]))
        if added:
            out.append((METHODS, list(old["methods"]), list(new["methods"]), f"adds {', '.join(added)}"))
        if new["path"] != old["path"]:
            out.extend(_path_widening(old["path"], new["path"], budget))
        return out

    def text(self, value: Mapping[str, Any]) -> str:
        port = f":{value['port']}" if value.get("port") is not None else ""
        return f"{','.join(value['methods'])} {value['host']}{port}{value['path']}"


def _path_widening(old: str, new: str, budget: Budget) -> list[Change]:
    try:
        verdict = compare(new, old, budget)
    except GlobTooLong as exc:  # no catalog writes such a glob: fail closed rather than spend without bound
        return [(PATH, old, new, f"not compared, counted as widened: {exc}")]
    if verdict.included:
        return []
    shortest = "" if verdict.shortest else " (not a shortest one: the diff's search budget ran out)"
    return [(PATH, old, new, f"admits {verdict.example!r}{shortest}, which the old path refused")]


KIND = HttpKind()
