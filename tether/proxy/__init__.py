"""The sidecar: mitmproxy with tether's addons. Modules mitmproxy imports and a sidecar never uses are deferred
first, before any of mitmproxy is imported (``deferred.py``)."""

from . import deferred  # noqa: F401
