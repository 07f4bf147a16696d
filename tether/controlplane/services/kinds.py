"""The kinds of document the services keep in the store, each owned by one service.

A document is stored by kind and id (``Store.put_doc``, ``get_doc``, ``list_docs``, ``cas_doc``). Each kind
has one owner, the service that writes it and says what its fields mean; another service may read it, by the
constant here, never by a bare string (``tests/test_layers.py`` checks both: no kind is spelled as a string
at a call, and only its owner writes it).

Why the constants live in one module and not in their owners: the owners import each other (the termination
service drives the event, approval and sidecar services, and those read the termination's commands), so a
constant in ``terminations.py`` could not be imported by ``events.py`` without a cycle. ``OWNERS`` keeps the
ownership next to the names.
"""

from __future__ import annotations

from collections.abc import Mapping

# terminations.py: a termination (by its id); a run's acknowledgement of one (by "termination id:run id");
# the standing command a termination gives every run of one link (by link hash), handed out by heartbeats
# and resyncs.
TERMINATION = "termination"
ACK = "ack"
COMMAND = "command"
# approvals.py: a held call and its decision (by approval id).
APPROVAL = "approval"
# grants.py: who owns an agent id (by the id, lower-cased): the first principal to register a link for it.
OWNER = "owner"
# operators.py: an operator (by name); the pointer from a token's hash to its operator; one single sign-on
# (by the hash of the token it was given); the provider account first signed in under a name (by name).
OPERATOR = "operator"
OPERATOR_TOKEN = "operator_token"
OIDC_SIGN_IN = "oidc_sign_in"
OIDC_NAME = "oidc_name"
# signin.py: an ID token exchanged once (by its hash), so a copied one buys nothing.
OIDC_ID_TOKEN_USED = "oidc_id_token_used"

OWNERS: Mapping[str, str] = {  # kind -> the module under services/ that writes it
    TERMINATION: "terminations",
    ACK: "terminations",
    COMMAND: "terminations",
    APPROVAL: "approvals",
    OWNER: "grants",
    OPERATOR: "operators",
    OPERATOR_TOKEN: "operators",
    OIDC_SIGN_IN: "operators",
    OIDC_NAME: "operators",
    OIDC_ID_TOKEN_USED: "signin",
}
