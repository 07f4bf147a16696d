"""The OpenAPI document, built from the same route table that wires the server, so they cannot drift."""

from __future__ import annotations

import re
from typing import Any

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "example": "tether.chain_revoked"},
                "message": {"type": "string"},
                "reason": {"type": "string"},
                "call_id": {"type": "string"},
                "capability": {"type": "string"},
            },
        }
    },
}

_AUTH = {
    "none": [],
    "admin": [{"admin": []}],
    "sidecar": [{"proof": []}],
    "admin-or-ancestor": [{"admin": []}, {"proof": []}],
    "admin-or-sidecar": [{"admin": []}, {"proof": []}],
}


def document(routes: list[Any]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        params = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in re.findall(r"{(\w+)}", route.path)
        ]
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.handler.__name__.removeprefix("h_"),
            "tags": [route.tag],
            "security": _AUTH[route.auth],
            "responses": {
                "200": {"description": "OK", "content": {route.produces: {"schema": {"type": "object"}}}},
                "default": {
                    "description": "A refusal with a stable code (also in the Tether-Error header)",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                },
            },
        }
        if params:
            op["parameters"] = params
        if route.method in ("POST", "PUT", "PATCH"):
            op["requestBody"] = {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}}
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "tether control plane", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR_SCHEMA},
            "securitySchemes": {
                "admin": {"type": "http", "scheme": "bearer", "description": "TETHER_ADMIN_TOKEN"},
                "proof": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Tether-Proof",
                    "description": "EdDSA JWS (typ tether-proof+jwt) over method, path and body hash, "
                    "signed with the key of the registered link it names",
                },
            },
        },
    }
