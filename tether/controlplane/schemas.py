"""JSON Schemas of the API's request and response bodies, named once and attached to routes where they are
declared (``ControlPlane.route(..., body=..., ok=...)``); ``openapi.py`` publishes them.

They say what the handlers enforce (``tether/controlplane/body.py``) and what they answer, so a client generator or
a fuzzer (tests/test_api_fuzz.py runs schemathesis over them) learns the real shapes. Objects stay open
(extra properties allowed): a field added later does not break a client that validates.
"""

from __future__ import annotations

from typing import Any

from tether.capability import protocol
from tether.capability.chain import MAX_LINKS
from tether.capability.events import APPROVED, CANCELLED, DENIED, EXPIRED, FILED, HELD, PENDING
from tether.capability.shared import RESOLUTIONS

Schema = dict[str, Any]

MAX_TTL_S = 10 * 365 * 86400  # a root grant's longest life
MAX_REASON = 2000
AGENT_ID = r"^[A-Za-z0-9._:-]{1,128}$"

STR: Schema = {"type": "string"}
NUM: Schema = {"type": "number"}
INT: Schema = {"type": "integer"}
BOOL: Schema = {"type": "boolean"}
ANY_OBJ: Schema = {"type": "object"}


def obj(properties: dict[str, Schema], *required: str, **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def array(items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "items": items, **extra}


def nullable(schema: Schema) -> Schema:
    """``schema`` or null (OpenAPI 3.1: a list of types)."""
    if "type" in schema and isinstance(schema["type"], str):
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


TIER: Schema = {"type": "string", "enum": ["direct", "approval", "absent"]}
STRINGS = array(STR)

# -- the refusal every route may answer (docs/contract.md section 5), also named in the Tether-Error header --------
ERROR: Schema = obj({
    "error": obj({
        "code": {"type": "string", "pattern": r"^tether\.[a-z_]+$", "examples": ["tether.bad_request"]},
        "message": STR,
        "reason": STR,
        "field": STR,
        "call_id": STR,
        "capability": STR,
        "link": INT,
        "jti": STR,
    }, "code", "message"),
}, "error")

# -- requests ------------------------------------------------------------------------------------------
JWK: Schema = obj({"kty": {"const": "OKP"}, "crv": {"const": "Ed25519"}, "x": STR}, "kty", "crv", "x")
GRANT_REQUEST = obj({
    "agent": {"type": "string", "pattern": AGENT_ID},
    "subject_key": {"oneOf": [{"type": "string", "description": "PEM public key"}, JWK]},
    "caps": {"type": "object", "additionalProperties": TIER},
    "role": {"type": "string", "maxLength": 200},
    "ttl_s": {"type": "number", "minimum": 1, "maximum": MAX_TTL_S, "default": 3600},
    "depth": {"type": "integer", "minimum": 0, "maximum": MAX_LINKS, "default": 3},
}, "agent", "subject_key")
REASON_REQUEST = obj({"reason": {"type": "string", "maxLength": MAX_REASON}})
CHAIN_REQUEST = obj({
    "chain": {"oneOf": [{"type": "string", "description": "the links, root first, joined by commas"},
                        array(STR, minItems=1)]},
}, "chain")
REGISTER_REQUEST = protocol.Register.schema()  # the same body, read by the message both sides use
TERMINATE_REQUEST = obj({
    "mode": {"type": "string", "enum": ["drain", "abort"], "default": "drain"},
    "window_s": {"type": ["number", "null"], "minimum": 0, "maximum": 86400, "default": 30},
    "reason": nullable({"type": "string", "maxLength": MAX_REASON}),
})
CALL: Schema = obj({
    "call_id": {"type": "string", "minLength": 1, "maxLength": 200},
    "agent": STR,
    "run_id": nullable({"type": "string", "maxLength": 64}),
    "capability": nullable(STR),
    "tier": nullable(STR),
    "method": nullable(STR),
    "url": nullable(STR),
    "started_at": nullable(NUM),
    "resolution": nullable(STR),
    "status": nullable(INT),
    "code": nullable(STR),
    "ended_at": nullable(NUM),
    "capture_ref": nullable(STR),
    "termination_id": nullable(STR),
    "detail": nullable(STR),
    "reissue_of": nullable(STR),  # an MCP call re-sending one that was cancelled (docs/mcp.md)
}, "call_id", description="A call report or start (capability.report.CallReport); fields beyond these are not "
   "kept")
# A final report (capability.report.read_final): what the call became, from the documented list. A batch with
# one report that is not so is refused whole (400 tether.bad_request naming the field); nothing is stored.
FINAL_CALL: Schema = {**CALL, "required": ["call_id", "resolution"], "properties": {
    **CALL["properties"], "resolution": {"type": "string", "enum": list(RESOLUTIONS)},
    "tier": {"anyOf": [TIER, {"type": "null"}]},
    "status": nullable({"type": "integer", "minimum": 100, "maximum": 599})},
    "description": "A call's final report (capability.report.read_final): its resolution is one of the list"}
# A write-ahead start names no resolution.
START: Schema = {**CALL, "properties": {**CALL["properties"], "resolution": {"type": "null"}},
                 "description": "A call's write-ahead start (capability.report.read_start): no resolution yet"}
HEARTBEAT_REQUEST = protocol.Heartbeat.schema()  # declared once, with the message both sides use
REPORTS_REQUEST = protocol.ReportBatch.schema()  # declared once, with the message; each item a call report
REPORTS_REQUEST["properties"].update(reports=nullable(array(FINAL_CALL)), starts=nullable(array(START)))
APPROVAL_REQUEST = protocol.ApprovalRequest.schema()  # declared once, with the message; the held call nested in it
APPROVAL_FILED = protocol.ApprovalFiled.schema()
QUIESCED_REQUEST = protocol.Quiesced.schema()
QUIESCED_REQUEST["properties"].update(reports=nullable(array(FINAL_CALL)), starts=nullable(array(START)))
APPROVE_REQUEST = obj({"call_hash": nullable({"type": "string", "maxLength": 200,
                                              "description": "the call_hash shown with the approval"})})
SIGN_IN_REQUEST = obj({"token": {"type": "string", "minLength": 1, "maxLength": 4096}}, "token")

# -- documents ----------------------------------------------------------------------------------------------
CLOCK = obj({"reference": {"enum": ["redis", "local"],
                           "description": "the clock compared with: the shared store's (Redis TIME), or, on the "
                                          "embedded store, this replica's own (offset 0, never skewed)"},
             "bound_s": NUM, "skewed": {"type": "boolean"},
             "offset_s": {**nullable(NUM), "description": "this clock minus the reference (positive: ahead); null "
                                                          "while unmeasured"},
             "uncertainty_s": {**nullable(NUM), "description": "half the round trip of the measurement used"},
             "reason": {"type": "string", "description": "when skewed: why"},
             "sidecars": obj({"offset_s": nullable(NUM), "runs": {"type": "integer", "minimum": 0}},
                             "offset_s", "runs")},
            "reference", "bound_s", "skewed", "offset_s", "uncertainty_s", "sidecars")
HEALTH = obj({"status": {"enum": ["ok", "unhealthy"]},
              "store": {"enum": ["ok", "unreachable", "unwritable"],
                        "description": "unwritable: it answers but refuses writes (a full disk, a read-only file "
                                       "system, Redis out of memory or refusing writes)"},
              "code": {"enum": ["tether.store_unavailable", "tether.store_unwritable", "tether.clock_skewed"],
                       "description": "when unhealthy: the code the API's writes (or, tether.clock_skewed, its "
                                      "terminations) answer with meanwhile"},
              "reason": {"type": "string", "description": "when unhealthy: why, in the store's own words"},
              "replica": STR, "catalog": STR, "clock": CLOCK},
             "status", "store", "replica", "catalog")
# Who made a decision: an operator's name and how they signed in (null when a principal or a termination did).
ATTRIBUTION = obj({"operator": STR, "via": {"enum": ["token", "oidc"]}, "at": NUM}, "operator", "via")
GRANT = obj({"agent": STR, "jti": STR, "link": STR, "chain": STRINGS, "issued_by": nullable(ATTRIBUTION)},
            "agent", "jti", "link", "chain")
REVOCATION = obj({"jti": STR, "agent": STR, "by": STR, "at": NUM, "reason": nullable(STR),
                  "termination_id": nullable(STR), "operator": nullable(ATTRIBUTION)}, "jti", "agent", "by", "at")
REVOKED = {**REVOCATION, "properties": {**REVOCATION["properties"], "agents_cut_off": STRINGS},
           "required": [*REVOCATION["required"], "agents_cut_off"]}
AGENT_REVOKED = obj({"agent": STR, "revoked": array(ref("Revocation"))}, "agent", "revoked")
REGISTERED = protocol.Registered.schema()
VERDICT = obj({"valid": BOOL, "agent": STR, "caps": ANY_OBJ, "exp": NUM, "jtis": STRINGS, "registered": BOOL,
               "error": ERROR["properties"]["error"]}, "valid")
RUN = obj({"run_id": nullable(STR), "agent": nullable(STR), "link": nullable(STR), "state": nullable(STR),
           "last_seen": nullable(NUM), "lease_expires": nullable(NUM), "lease": {"enum": ["live", "expired"]},
           "inflight": INT, "proxy": nullable(STR), "pid": nullable(INT), "started_at": nullable(NUM),
           "superseded_by": nullable(STR)}, "run_id", "lease")
AGENT_NODE = obj({
    "agent": STR, "jti": STR, "link": STR, "issuer": STR, "parent_link": nullable(STR), "caps": ANY_OBJ,
    "depth": INT, "exp": NUM, "status": {"enum": ["active", "revoked", "expired"]},
    "revoked": nullable(ref("Revocation")), "revoked_via": nullable(STR), "sidecar": nullable(ref("Run")),
    "registered_by": nullable(ATTRIBUTION),
    "runs": array(ref("Run")),
}, "agent", "jti", "link", "issuer", "caps", "status", "runs")
TREE_NODE = {"allOf": [ref("Agent"), obj({"children": array(ref("AgentTree"))}, "children")]}
AGENTS = obj({"agents": array(ref("Agent")), "tree": array(ref("AgentTree"))}, "agents", "tree")
SUBTREE = obj({"agent": STR, "agents": STRINGS, "links": array(obj({"agent": STR, "jti": STR}, "agent", "jti"))},
              "agent", "agents", "links")
EVENT = obj({"seq": INT, "kind": STR, "target": nullable(STR), "payload": ANY_OBJ, "at": NUM},
            "seq", "kind", "payload")
APPROVAL = obj({
    "id": STR, "agent": STR, "link": nullable(STR), "run_id": nullable(STR), "call_id": STR,
    "capability": nullable(STR), "method": nullable(STR), "url": nullable(STR), "summary": nullable(STR),
    "request": nullable(ANY_OBJ), "call_hash": nullable(STR), "chain": STRINGS, "deciders": STRINGS,
    "status": {"enum": [PENDING, APPROVED, DENIED, CANCELLED, EXPIRED]}, "requested_at": NUM, "expires_at": NUM,
    "decided_at": nullable(NUM), "decided_by": nullable(STR), "operator": nullable(ATTRIBUTION), "version": INT,
    "origin": {"enum": [HELD, FILED, None], "description": f"of a pending approval: {HELD} when its sidecar run's "
               f"last heartbeat lists the call held, {FILED} when no run of its link does (filed with the agent's "
               "key, or its sidecar's next heartbeat has not come yet)"},
}, "id", "agent", "call_id", "status", "requested_at", "expires_at")
APPROVAL_SUMMARY = obj({
    "pending": INT, "held": INT, "filed": INT,
    "agents": {"type": "object", "additionalProperties": obj({"pending": INT, HELD: INT, FILED: INT}),
               "description": "per agent with a pending approval"},
    "limits": obj({"per_run": INT, "per_link": INT}, description="pending approvals a sidecar run, and a link, "
                  "may have at once (tether.approval_queue_full past either)"),
}, "pending", "held", "filed", "agents", "limits")
EVENTS = protocol.Events.schema()  # declared once, with the message both sides use; the items named here
EVENTS["properties"].update(events=array(ref("Event")), approvals=nullable(array(ref("Approval"))))
LEASE = protocol.Lease.schema()
ACCEPTED = protocol.Accepted.schema()
SLICE_REQUEST = protocol.SliceRequest.schema()  # the budget slices' messages, declared once (protocol.py)
SLICE_LEASE = protocol.SliceLease.schema()
SLICE_RETURN = protocol.SliceReturn.schema()
SLICES_SETTLED = protocol.SlicesSettled.schema()
REPORTS = array(ref("Call"))
APPROVALS = array(ref("Approval"))
ENTRY = obj({"tier": TIER, "wire": ANY_OBJ, "budget": nullable(ANY_OBJ)}, "tier")
SURFACE = obj({
    "version": {"type": "integer", "enum": [1, 2]},
    "catalog": STR,
    "agents": {"type": "object", "additionalProperties": {
        "type": "object", "additionalProperties": {"oneOf": [TIER, ENTRY]}}},
}, "agents", description="tether audit surface --json (version 1 or 2)")
DIFF_REQUEST = obj({"old": ref("Surface"), "new": ref("Surface")}, "old", "new")
DIFF = obj({"widened": STRINGS, "exit": {"enum": [0, 1]}}, "widened", "exit")
TERMINATION = obj({
    "id": STR, "subject": STR, "mode": {"enum": ["drain", "abort"]}, "window_s": NUM, "reason": nullable(STR),
    "requested_by": STR, "requested_at": NUM, "grace_s": NUM, "deadline": NUM, "agents": STRINGS,
    "links": STRINGS, "state": {"enum": ["requested", "draining", "aborting", "reconciling", "terminated"]},
    "history": array(ANY_OBJ), "completed_at": nullable(NUM), "record_id": nullable(STR), "version": INT,
    "operator": nullable(ATTRIBUTION),
}, "id", "subject", "mode", "state", "agents")
TERMINATION_STARTED = {"allOf": [ref("Termination"), obj({"termination_id": STR}, "termination_id")]}
TERMINATION_VIEW = {"allOf": [ref("Termination"), obj({
    "acknowledged": STRINGS, "waiting_for": STRINGS, "never_ran": STRINGS, "calls_in_flight": INT,
    "remaining_s": NUM}, "acknowledged", "waiting_for")]}
TERMINATIONS = array(ref("Termination"))
QUIESCED = obj({"ok": BOOL, "run_id": nullable(STR)}, "ok")
RECORD = obj({
    "record_id": STR, "termination_id": STR, "subject": STR, "mode": STR, "requested_by": STR,
    "operator": nullable(ATTRIBUTION), "requested_at": NUM, "completed_at": NUM, "window_s": NUM,
    "calls": array(ANY_OBJ), "leases": array(ANY_OBJ),
    "agents_terminated": array({}), "agents_unaccounted": array(ANY_OBJ),
    "amends": {"type": "string", "description": "an addendum: the record of the same termination it amends"},
    "accounts_for": array(obj({"record_id": STR, "termination_id": STR, "agents": STRINGS, "call_ids": STRINGS},
                              "record_id", "termination_id", "agents", "call_ids"),
                          description="earlier records of overlapping terminations that listed as unaccounted "
                                      "agents this record confirms, or as unknown calls it reports"),
    "calls_held_by": array(obj({"record_id": STR, "termination_id": STR, "calls": INT},
                               "record_id", "termination_id", "calls"),
                           description="earlier records holding as reported calls of this subtree, which this "
                                       "record therefore leaves out (a call belongs to exactly one record)"),
    "segments": array(obj({"link": STR, "agent": STR, "seq": INT, "head": STR, "count": INT},
                          "link", "agent", "seq", "head", "count"),
                      description="record form 2: the chains of sealed segments whose calls are this record's "
                                  "too (served expanded in calls; docs/termination.md, Sealed segments)"),
    "sealed": array(ANY_OBJ, description="as served: the headers of the segments named, chain by chain"),
    "calls_from": array(array(INT), description="as served: [source, n] runs over calls, source an index into "
                                                "sealed or -1 for the record's own calls (the hashed ones)"),
    "prev_hash": STR, "hash": STR, "signature": STR,
}, "record_id", "termination_id", "subject", "calls", "agents_terminated", "agents_unaccounted", "prev_hash",
    "hash", "signature")
RECORDS = array(ref("Record"))
RECORDS_VERIFICATION = obj({
    "valid": BOOL, "count": INT, "problems": STRINGS,
    "records": {"type": "object", "additionalProperties": obj({"verified": BOOL, "problems": STRINGS,
                                                               "proved": BOOL}, "verified", "problems")},
    "checkpoint": obj({"origin": STR, "size": INT, "note": STR, "witnesses": array(obj({
        "url": STR, "size": INT, "cosigned": BOOL, "name": nullable(STR)}, "url", "size", "cosigned"))},
        "origin", "size", "note", "witnesses"),
}, "valid", "count", "problems", "records")
TRUST = obj({"public_key": STR, "jwk": JWK, "catalog": STR}, "public_key", "jwk", "catalog")
CATALOG = obj({"hash": STR, "catalog": ANY_OBJ}, "hash", "catalog")
SESSION = obj({"csrf": STR, "expires_at": NUM, "operator": STR, "via": STR, "roles": STRINGS}, "csrf", "expires_at",
              "operator", "roles")
SIGNED_OUT = obj({"signed_out": BOOL}, "signed_out")
HAR = obj({"log": ANY_OBJ}, "log", description="HAR 1.2")
OPENAPI = obj({"openapi": STR, "info": ANY_OBJ, "paths": ANY_OBJ}, "openapi", "info", "paths")

# Named in components.schemas (referenced above with ``ref``).
COMPONENTS: dict[str, Schema] = {
    "Error": ERROR,
    "Revocation": REVOCATION,
    "Run": RUN,
    "Agent": AGENT_NODE,
    "AgentTree": TREE_NODE,
    "Event": EVENT,
    "Approval": APPROVAL,
    "Call": CALL,
    "Surface": SURFACE,
    "Termination": TERMINATION,
    "Record": RECORD,
}

__all__ = ["COMPONENTS", "MAX_REASON", "MAX_TTL_S", "Schema"]
