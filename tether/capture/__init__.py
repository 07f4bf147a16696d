"""The capture format, read by both sides: segments on disk and reading flows back (``segments``), the retention
policy (``retention``, pure) and HAR export (``har``).

The sidecar writes captures (tether/proxy/capture.py: redaction, encoding, the writer); ``tether capture export``
and the control plane's console read them. Both may import this package; it imports the shared model and
mitmproxy's flow reader, never ``tether.proxy`` or ``tether.controlplane`` (tests/test_layers.py).
"""
