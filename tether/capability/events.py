"""The words both sides must agree on when the control plane tells a sidecar something: the event kinds on
the sequence-numbered stream, and the states and decisions of an approval.

A revocation, a termination's command and an approval's decision each travel as one event; a sidecar acts
on the kind. Pure constants, no I/O: the sidecar and the control plane import them from here, so neither
spells them alone.
"""

from __future__ import annotations

# Event kinds on /v1/events (docs/contract.md section 4).
REVOKE = "revoke"  # a link was revoked: every chain containing it dies
COMMAND = "command"  # a termination's drain or abort, for every run of one link
APPROVAL = "approval"  # a held call was decided
KINDS = (REVOKE, COMMAND, APPROVAL)

# An approval's status. ``cancelled`` is a termination's, never a person's: the held call resolves
# ``cancelled_not_sent``, not as a denial. ``expired`` is only ever shown, never stored.
PENDING, APPROVED, DENIED, CANCELLED, EXPIRED = "pending", "approved", "denied", "cancelled", "expired"
DECISIONS = (APPROVED, DENIED, CANCELLED)

# Where a pending approval comes from, as the control plane can tell: ``held`` when the sidecar run that filed it
# lists the call held in its last heartbeat, ``filed`` when no run of the link does (a request made with the
# agent's key outside a held call, or one whose sidecar has not sent its next heartbeat yet).
HELD, FILED = "held", "filed"

# The most of a held call's body an approver is shown, whole (bytes): the sidecar refuses an approval-tier call
# with a longer body and the control plane files none (``tether.approval_body_too_large``).
APPROVAL_BODY_LIMIT = 1024 * 1024


def by_termination(termination_id: str) -> str:
    """Who acted, when a termination did (a revocation's ``by``, a cancelled approval's ``decided_by``)."""
    return f"termination:{termination_id}"
