"""The ``tether`` command: one package above both sides.

``cli.main`` builds the parser from one ``add_parser`` function per command and runs the chosen command; each
command module imports what it needs (mitmproxy, the control plane's server) only when its command runs, so
``tether sidecar`` and ``tether run`` load nothing of the control plane.
"""
