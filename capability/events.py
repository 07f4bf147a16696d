"""The words both sides must agree on when the control plane tells a sidecar something: the event kinds on
the sequence-numbered stream, and the states and decisions of an approval.

A revocation, a termination's command and an approval's decision each travel as one event; a sidecar acts
on the kind. Pure constants, no I/O: the sidecar and the control plane import them from here, so neither
spells them alone.
"""

from __future__ import annotations

# Event kinds on /v1/events (DESIGN.md section 4).
REVOKE = "revoke"  # a link was revoked: every chain containing it dies
COMMAND = "command"  # a termination's drain or abort, for every run of one link
APPROVAL = "approval"  # a held call was decided
KINDS = (REVOKE, COMMAND, APPROVAL)

# An approval's status. ``cancelled`` is a termination's, never a person's: the held call resolves
# ``cancelled_not_sent``, not as a denial. ``expired`` is only ever shown, never stored.
PENDING, APPROVED, DENIED, CANCELLED, EXPIRED = "pending", "approved", "denied", "cancelled", "expired"
DECISIONS = (APPROVED, DENIED, CANCELLED)


def by_termination(termination_id: str) -> str:
    """Who acted, when a termination did (a revocation's ``by``, a cancelled approval's ``decided_by``)."""
    return f"termination:{termination_id}"
