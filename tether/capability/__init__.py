"""The capability model: catalog, keys, grant links and chains. Pure code, no I/O, no clock of its own.

The sidecar imports it to enforce; the control plane imports it to issue and to verify.
"""
