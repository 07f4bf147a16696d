"""The security team's web console at ``/ui/``, and the few read-only API routes it needs.

The console is a client of the documented JSON API: static HTML, CSS and small vanilla JS modules
(``static/``, committed, no build step, no CDN), served here with a sign-in that turns an operator's token
into a server-side session (an HttpOnly, SameSite=Strict cookie, ``__Host-`` prefixed and Secure over TLS;
the JSON API accepts it as that operator, with that operator's roles, and every change made with it must
carry the session's CSRF token: ``tether/controlplane/auth.py``).

Routes added: the pages, sign-in and logout (``/ui/...``: every view and every object has its own address,
``/ui/agents/AGENT``, ``/ui/calls/CALL_ID``, ...: the same page, which reads its address); ``GET
/v1/agents/{agent}/subtree`` (who a revoke or terminate would cut, for the confirmation); ``POST
/v1/audit/diff`` (two surface documents, what widened); ``GET /v1/audit/records`` (the record log's
verification, per record); ``GET /v1/calls`` (search over the call reports) and ``GET /v1/calls/{call_id}``
(one call: its report, the records and approvals that name it, its captured request and response); and ``GET
/v1/captures/har`` (a HAR of the captures the control plane can read, when ``TETHER_CAPTURES`` names the
sidecars' state dirs).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tether.capability.errors import NOT_FOUND, RATE_LIMITED, UNAUTHORIZED, ApiError, TetherError

from .. import audit
from .. import schemas as sc
from ..auth import BOOTSTRAP, CSRF_HEADER, READ, SESSION_COOKIE, TLS_SESSION_COOKIE, Operator
from ..body import bad, query_int, read_json
from ..routes import ADMIN, NONE
from .calls import captured_call, export_har, find_calls
from .sessions import Sessions, SignInThrottle

if TYPE_CHECKING:
    from ..app import ControlPlane

STATIC = Path(__file__).parent / "static"
ASSETS = {p.name: p for p in STATIC.iterdir() if p.suffix in (".js", ".css", ".html", ".svg")}
CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
# The page's own addresses (``/ui/VIEW`` and ``/ui/VIEW/ID``): the page reads the rest of its address itself.
VIEWS = ("agents", "approvals", "calls", "terminations", "records", "audit", "search")
CALL_VIEW = sc.obj({
    "call": sc.ref("Call"),
    "records": sc.array(sc.obj({"record_id": sc.STR, "termination_id": sc.STR}, "record_id", "termination_id")),
    "approvals": sc.array(sc.ref("Approval")),
    "capture": sc.nullable(sc.obj({"request": sc.ANY_OBJ, "response": sc.ANY_OBJ, "_tether": sc.ANY_OBJ},
                                  description="the call's HAR 1.2 entry, redacted as captured; a body past "
                                              "256 KiB is cut, its content's _truncated giving its length")),
    "capture_note": sc.nullable(sc.STR),
}, "call", "records", "approvals", "capture", "capture_note")
NO_CAPTURES = ("this control plane reads no captures: start it with TETHER_CAPTURES=DIR (the sidecars' state "
               "dirs), or use tether capture export")


def diff_surfaces(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What became more reachable from ``old`` to ``new`` (the release gate's own containment diff, version 1
    and 2 surfaces alike): the one place the console's diff is computed."""
    found, _notes = audit.diff(old, new)
    return [w.line() for w in found]


class Console:
    def __init__(self, cp: ControlPlane, captures: Path | None, sessions: Sessions) -> None:
        self.cp = cp
        self.captures = captures
        self.sessions = sessions
        self.throttle = SignInThrottle()

    # -- pages -----------------------------------------------------------------------------------------------
    async def h_root(self, request: web.Request) -> web.Response:
        raise web.HTTPPermanentRedirect("/ui/")

    async def h_index(self, request: web.Request) -> web.Response:
        return self._asset("index.html")

    async def h_page(self, request: web.Request) -> web.Response:
        view = request.match_info["view"]
        if view not in VIEWS:
            raise ApiError(404, NOT_FOUND, f"the console has no view {view} (its views: {', '.join(VIEWS)})")
        return self._asset("index.html")

    async def h_asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise ApiError(404, NOT_FOUND, f"no console file {name}")
        return self._asset(name)

    def _asset(self, name: str) -> web.Response:
        path = ASSETS[name]
        return web.Response(body=path.read_bytes(), content_type=CONTENT_TYPES[path.suffix], charset="utf-8",
                            headers=PAGE_HEADERS)

    # -- sign-in -------------------------------------------------------------------------------------------------
    async def h_sign_in(self, request: web.Request) -> web.Response:
        """An operator's token (or the bootstrap admin token) becomes a session. A wrong token counts against
        its source (``SignInThrottle``); a token that cannot be guessed signs in even from a throttled source,
        so failing on purpose locks nobody out."""
        body, _ = await read_json(request)
        token = str(body.string("token", required=True, nullable=False, max_len=4096, non_empty=True)).strip()
        client, now = request.remote or "?", self.cp.clock()
        who = await self.cp.auth.by_token(token)
        unguessable = who is not None and (who.name != BOOTSTRAP or len(token) >= self.throttle.STRONG_CHARS)
        if not unguessable:
            wait = self.throttle.retry_after(client, now)
            if wait > 0:
                raise ApiError(429, RATE_LIMITED, f"too many wrong tokens from {client}; try again in {wait:.0f}s "
                               "(an operator's own token is never held back)", retry_after_s=round(wait, 1))
        if who is None:
            self.throttle.failed(client, now)
            self.cp.metrics.inc("tether_console_sign_in_refused_total")
            raise ApiError(401, UNAUTHORIZED, "that is not an operator's token (tether operators add), nor the "
                           "control plane's TETHER_ADMIN_TOKEN")
        session = self.sessions.create(now, who)
        response = web.json_response(_session_view(session))
        response.set_cookie(self.sessions.cookie, session.sid, path="/", httponly=True, samesite="Strict",
                            secure=self.sessions.tls or _https(request), max_age=int(self.sessions.ttl_s))
        return response

    async def h_session(self, request: web.Request) -> web.Response:
        who = await self.cp.auth.session_operator(request)
        session = self.sessions.get(request.cookies.get(self.sessions.cookie, ""), self.cp.clock())
        if who is None or session is None:
            raise ApiError(401, UNAUTHORIZED, "not signed in (or the session expired, or its operator's token was "
                           "rotated or revoked): sign in with your token")
        return web.json_response(_session_view(session))

    async def h_logout(self, request: web.Request) -> web.Response:
        sid = request.cookies.get(self.sessions.cookie, "")
        if self.sessions.get(sid, self.cp.clock()) is not None:
            await self.cp.auth.require(request, READ, "sign out")  # the session's CSRF token, as for any change
            self.sessions.end(sid)
        response = web.json_response({"signed_out": True})
        response.del_cookie(self.sessions.cookie, path="/")
        return response

    # -- read-only API the console needs ----------------------------------------------------------------------
    async def h_subtree(self, request: web.Request) -> web.Response:
        agent = request.match_info["agent"]
        links = (await self.cp.grants.graph()).subtree(agent)
        if not links:
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        return web.json_response({
            "agent": agent,
            "agents": sorted({link["sub"] for link in links}),
            "links": sorted(({"agent": link["sub"], "jti": link["jti"]} for link in links),
                            key=lambda d: (d["agent"], d["jti"])),
        })

    async def h_diff(self, request: web.Request) -> web.Response:
        body, _ = await read_json(request)
        old, new = body.obj("old", required=True), body.obj("new", required=True)  # audit surface documents
        try:
            # Off the event loop: a large document costs seconds (bounded: ``audit.diff``'s budget), and the
            # sidecars' heartbeats and leases must keep being answered meanwhile.
            widened = await asyncio.to_thread(diff_surfaces, old or {}, new or {})
        except audit.SurfaceError as exc:
            raise bad(f"not an audit surface document: {exc}") from None
        return web.json_response({"widened": widened, "exit": 1 if widened else 0})

    async def h_verify_records(self, request: web.Request) -> web.Response:
        records = await self.cp.records.heads()  # headers: a record's calls are hashed a page at a time
        result = await self.cp.records.verify(self.cp.signing_key.public_key(), records)
        status = {}
        for index, record in enumerate(records):
            mark = f"record {index} ({record.get('record_id', f'#{index}')})"
            problems = [p for p in result.problems if p.startswith(mark + ":")]
            status[record.get("record_id", f"#{index}")] = {"verified": not problems, "problems": problems}
        checkpoint = await self._checkpoint(records, status)
        return web.json_response({"valid": result.ok, "count": result.count, "problems": list(result.problems),
                                  "records": status, "checkpoint": checkpoint})

    async def _checkpoint(self, heads: list[dict[str, Any]], status: dict[str, Any]) -> dict[str, Any]:
        """The latest checkpoint, the witnesses it goes to, and each record's ``proved``: its inclusion proof
        checks out against the checkpoint's root (what an auditor's ``records verify-one`` would say)."""
        from ..merkle import record_leaf, verify_inclusion

        service = self.cp.checkpoints
        tree = await service.tree(heads)
        root = tree.root()
        for index, head in enumerate(heads[:tree.size]):
            entry = status.get(head.get("record_id", f"#{index}"))
            if entry is not None:
                entry["proved"] = verify_inclusion(record_leaf(str(head.get("hash", ""))), index, tree.size,
                                                   tree.inclusion_proof(index), root)
        witnesses = [{"url": w.url, "size": w.size, "cosigned": bool(w.cosigned),
                      "name": w.cosigned.split(" ")[1] if w.cosigned.count(" ") >= 2 else None}
                     for w in service.witnesses]
        return {"origin": service.origin, "size": tree.size, "note": await service.checkpoint(tree),
                "witnesses": witnesses}

    async def h_calls(self, request: web.Request) -> web.Response:
        """A page of the call reports matching ``q`` (every word), ``agent`` and ``resolution``, newest first;
        ``Tether-Total`` counts every match."""
        query = request.query
        offset, limit = query_int(request, "offset", 0), query_int(request, "limit", -1)
        if offset < 0 or limit < -1:
            raise bad("'offset' and 'limit' must not be negative", field="offset" if offset < 0 else "limit")
        agent = query.get("agent")
        found = find_calls(await self.cp.records.reports(agent), query.get("q", ""), agent,
                           query.get("resolution"))
        page = found[offset:] if limit == -1 else found[offset:offset + limit]
        return web.json_response(page, headers={"Tether-Total": str(len(found))})

    async def h_call(self, request: web.Request) -> web.Response:
        """One call: its final report (else its entry in a record), the records that list it, the approvals
        filed for it, and its captured request and response (a HAR entry, bodies cut at ``BODY_SHOWN``)."""
        call_id = request.match_info["call_id"]
        listed = await self._listed(call_id)
        reports = await self.cp.records.reports_among([call_id])
        call = reports[0] if reports else (listed[-1]["call"] if listed else None)
        if call is None:
            raise ApiError(404, NOT_FOUND, f"no call {call_id} (no sidecar reported it and no record lists it)")
        approvals, _ = await self.cp.approvals.find(None, call.get("agent"))
        capture, note = None, None
        if self.captures is None:
            note = NO_CAPTURES
        else:
            capture = await asyncio.to_thread(captured_call, self.captures, call)  # reads a capture file
            if capture is None:
                note = (f"no capture holds this call ({call.get('capture_ref')})" if call.get("capture_ref")
                        else "the sidecar captured nothing of this call (it never left, or was not captured)")
        return web.json_response({
            "call": call,
            "records": [{"record_id": r["record_id"], "termination_id": r["termination_id"]} for r in listed],
            "approvals": [a for a in approvals if a.get("call_id") == call_id],
            "capture": capture,
            "capture_note": note,
        })

    async def _listed(self, call_id: str) -> list[dict[str, Any]]:
        """The records that list the call, oldest first, each with its entry for it (records are read a page
        of calls at a time, and only the lines that name the call are decoded)."""
        needle, out = json.dumps(call_id), []
        for head in await self.cp.records.heads():
            async for page in self.cp.records.every_call(head):
                for text in page:
                    if needle in text and (call := json.loads(text)).get("call_id") == call_id:
                        out.append({"record_id": head["record_id"], "termination_id": head["termination_id"],
                                    "call": call})
        return out

    async def h_har(self, request: web.Request) -> web.Response:
        if self.captures is None:
            raise ApiError(404, "tether.capture_unavailable", NO_CAPTURES)
        query = request.query
        termination, agent, call_id = query.get("termination"), query.get("agent"), query.get("call")
        record = None
        if termination:
            record = await self.cp.records.record(termination)  # by its record id or its termination's; or 404
            calls = record["calls"]
        elif call_id:
            calls = await self.cp.records.reports_among([call_id])
            if not calls:
                raise ApiError(404, NOT_FOUND, f"no call report {call_id}")
            record = {"calls": calls}  # the flows of these calls only
        else:
            calls = await self.cp.records.reports(agent)
        try:
            har = await asyncio.to_thread(export_har, self.captures, record, agent, calls, query.get("since"),
                                          query.get("until"))
        except TetherError as exc:
            raise bad(str(exc)) from None
        name = f"tether-{termination or call_id or agent or 'calls'}.har"
        return web.Response(text=json.dumps(har, indent=1), content_type="application/json",
                            headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _session_view(session: Any) -> dict[str, Any]:
    who: Operator = session.operator
    return {"csrf": session.csrf, "expires_at": session.expires_at, "operator": who.name, "via": who.via,
            "roles": sorted(who.roles)}


def _https(request: web.Request) -> bool:
    return request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https"


def install(cp: ControlPlane, captures: str | Path | None = None, sessions: Sessions | None = None,
            tls: bool = False) -> Console:
    """Add the console's pages and routes to ``cp``; its sessions act as their operators for the API.
    ``tls``: the control plane is served over TLS (the session cookie is ``__Host-`` prefixed and Secure)."""
    root = captures or os.environ.get("TETHER_CAPTURES")
    console = Console(cp, Path(root) if root else None, sessions or Sessions(tls=tls))
    cp.auth.sessions = console.sessions
    r = cp.route
    r("GET", "/ui", console.h_root, "The console (redirects to /ui/)", NONE, "console", status=308, content=None)
    r("GET", "/ui/", console.h_index, "The console", NONE, "console", content="text/html", ok={"type": "string"})
    r("GET", "/ui/{view}", console.h_page, "A view of the console (the page reads its address)", NONE, "console",
      content="text/html", ok={"type": "string"})
    r("GET", "/ui/{view}/{id}", console.h_page, "One object in a view of the console (agent, approval, call, "
      "termination, record)", NONE, "console", content="text/html", ok={"type": "string"})
    r("GET", "/ui/static/{name}", console.h_asset, "The console's scripts and styles", NONE, "console",
      content="*/*", ok={"type": "string"})
    r("POST", "/ui/session", console.h_sign_in, "Sign in with an operator's token: sets the session cookie", NONE,
      "console", body=sc.SIGN_IN_REQUEST, ok=sc.SESSION)
    r("GET", "/ui/session", console.h_session, "The signed-in session's CSRF token", NONE, "console",
      ok=sc.SESSION)
    r("POST", "/ui/logout", console.h_logout, "End the session", NONE, "console", ok=sc.SIGNED_OUT)
    r("GET", "/v1/agents/{agent}/subtree", console.h_subtree, "Who terminating or revoking an agent cuts", ADMIN,
      "agents", ok=sc.SUBTREE)
    r("POST", "/v1/audit/diff", console.h_diff, "What widened between two audit surface documents", ADMIN, "audit",
      body=sc.DIFF_REQUEST, ok=sc.DIFF, roles=READ)  # a read, though a POST (two documents in the body)
    r("GET", "/v1/audit/records", console.h_verify_records, "The record log's verification, per record", ADMIN,
      "records", ok=sc.RECORDS_VERIFICATION)
    r("GET", "/v1/calls", console.h_calls, "Search the call reports: newest first; the Tether-Total header counts "
      "every match", ADMIN, "records", ok=sc.REPORTS, query=(
          ("q", sc.STR, "words each found in the agent, call id, capability, method, URL, resolution, code, "
                        "termination, run or status"),
          ("agent", sc.STR, "only this agent's calls"), ("resolution", sc.STR, "only calls resolved so"),
          ("offset", sc.INT, "skip this many (paging)"), ("limit", sc.INT, "at most this many")))
    r("GET", "/v1/calls/{call_id}", console.h_call, "One call: its report, the records and approvals naming it, "
      "its captured request and response", ADMIN, "records", ok=CALL_VIEW)
    r("GET", "/v1/captures/har", console.h_har, "HAR of captured calls (by termination, call, agent or time "
      "range)", ADMIN, "records", ok=sc.HAR, query=(
          ("termination", sc.STR, "a termination or record id"), ("call", sc.STR, "one call (its call id)"),
          ("agent", sc.STR, "one agent's calls"),
          ("since", sc.STR, "from this time (ISO 8601 or epoch seconds)"), ("until", sc.STR, "until this time")))
    return console


__all__ = ["CSRF_HEADER", "SESSION_COOKIE", "TLS_SESSION_COOKIE", "Console", "diff_surfaces", "install"]
