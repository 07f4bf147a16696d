"""The OpenAPI document, built from the same route table that wires the server, so they cannot drift.

Each route carries its request schema, its success status and schema, its query parameters and its auth
(``routes.Route``); the shapes themselves live in ``schemas.py``. Every refusal is documented with the
``{"error": {...}}`` body and its ``Tether-Error`` header.
"""

from __future__ import annotations

import re
from typing import Any

from .auth import ROLES
from .schemas import COMPONENTS, ref

_AUTH = {
    "none": [],
    "admin": [{"admin": []}, {"session": []}],
    "sidecar": [{"proof": []}],
    "run": [{"proof": []}],
    "admin-or-ancestor": [{"admin": []}, {"session": []}, {"proof": []}],
    "admin-or-sidecar": [{"admin": []}, {"session": []}, {"proof": []}],
    "admin-or-holder": [{"admin": []}, {"session": []}, {"proof": []}],
}

# The refusals a route can answer, by what it takes: who may call it, whether it has a body and path ids.
REFUSALS = {
    400: "Malformed, oversized, too deeply nested or ill-typed input (tether.bad_request); the message names "
         "the field",
    401: "No credentials, or a Tether-Proof that does not verify (tether.unauthorized)",
    403: "Authenticated, but not allowed (tether.forbidden, tether.csrf, tether.chain_invalid...)",
    404: "Nothing by that id (tether.not_found)",
    409: "The state does not allow it (tether.conflict, or the chain's state: tether.chain_revoked...)",
    413: "The body is larger than the API reads (tether.bad_request)",
    503: "The store is unreachable (tether.store_unavailable) or refuses writes (tether.store_unwritable: a full "
         "disk, a read-only file system, Redis out of memory); retry later",
}

_ERROR_RESPONSE_HEADERS = {
    "Tether-Error": {"description": "The refusal's stable code, as in the body", "required": True,
                     "schema": {"type": "string", "pattern": r"^tether\.[a-z_]+$"}},
}


def refusal(status: int | str, description: str) -> dict[str, Any]:
    """A refusal's response object (a route's ``extra_responses`` use it to say more than the default)."""
    return {"description": description, "headers": _ERROR_RESPONSE_HEADERS,
            "content": {"application/json": {"schema": ref("Error")}}}


def _responses(route: Any) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": route.summary}
    if route.content is not None:
        ok["content"] = {route.content: {"schema": route.ok if route.ok is not None else {}}}
    responses: dict[str, Any] = {str(route.status): ok}
    statuses = {400, 503}
    if route.auth != "none":
        statuses |= {401, 403}
    if "{" in route.path or route.auth != "none":
        statuses.add(404)
    if route.method == "POST":
        statuses |= {409, 413}
    for status in sorted(statuses - {route.status}):
        responses[str(status)] = refusal(status, REFUSALS[status])
    responses.update({str(k): v for k, v in route.extra_responses.items()})
    responses["default"] = refusal("default", "Any other refusal, in the same shape")
    return responses


def document(routes: list[Any]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        params: list[dict[str, Any]] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for name in re.findall(r"{(\w+)}", route.path)
        ]
        params += [{"name": name, "in": "query", "required": False, "schema": schema, "description": text}
                   for name, schema, text in route.query]
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.handler.__name__.removeprefix("h_"),
            "tags": [route.tag],
            "security": _AUTH[route.auth],
            "responses": _responses(route),
        }
        if route.roles is not None:  # the operator roles it allows (tether/controlplane/auth.py ROLES)
            op["x-tether-roles"] = [r for r in ROLES if r in route.roles]
        if params:
            op["parameters"] = params
        if route.body is not None:
            op["requestBody"] = {"required": False, "content": {"application/json": {"schema": route.body}}}
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "tether control plane", "version": "1",
                 "description": "Every refusal is {\"error\": {\"code\", \"message\", ...}} with the code in the "
                                "Tether-Error header (docs/contract.md section 5)."},
        "paths": paths,
        "components": {
            "schemas": COMPONENTS,
            "securitySchemes": {
                "admin": {"type": "http", "scheme": "bearer", "description": "An operator's token (TETHER_TOKEN, "
                          "from tether operators add) or TETHER_ADMIN_TOKEN; the route's x-tether-roles say which "
                          "roles may call it"},
                "proof": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Tether-Proof",
                    "description": "EdDSA JWS (typ tether-proof+jwt) over method, path and body hash, signed with "
                    "the key of the registered link it names, dated within the last 60 s (at most 5 s ahead), "
                    "used once",
                },
                "session": {
                    "type": "apiKey",
                    "in": "cookie",
                    "name": "tether_session",
                    "description": "The console's session (POST /ui/session with an operator's token; "
                    "__Host-tether_session when served over TLS); a change made "
                    "with it must also carry the session's X-CSRF-Token header",
                },
            },
        },
    }
