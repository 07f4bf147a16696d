"""tether: make a fleet of AI agents stoppable.

One import namespace: ``tether.capability`` (the pure model: chains, catalog, grants, proofs),
``tether.proxy`` (the sidecar), ``tether.controlplane`` (the control plane) and ``tether.cli`` (the command).
"""
