"""The control plane's logic over the store, one small class per concern, with no HTTP in them.

``events`` (the sequence-numbered event log and its fan-out), ``grants`` (issuing, registering, verifying
and revoking links; agent-id ownership; the agent graph), ``sidecars`` (runs and their leases),
``approvals`` (held calls and their decisions), ``records`` (call reports in, the record log out) and
``terminations`` (the driver of the pure protocol in ``tether/controlplane/termination.py``), ``health``
(readiness). Each takes the store, the clock and the other services it uses; ``tether/controlplane/routes/``
and the console answer HTTP over them and never touch the store themselves. ``kinds`` names the documents
the services keep, each kind written by its one owner.
"""
