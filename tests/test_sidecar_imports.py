"""A sidecar process loads the mitmproxy addons it runs, not mitmproxy's whole default set (issue 17: a
lighter sidecar). Checked in fresh interpreters; the memory figures are in bench/RESULTS.md."""

from __future__ import annotations

import json
import subprocess

from .harness import PYTHON

# Loaded only by default addons a sidecar does not run (the onboarding app, proxy auth, flow filters' users), by
# reading flow files (mitmproxy.io: the HAR export's business, in the CLI process), or by reading a catalog file
# (yaml: a sidecar gets its catalog from the control plane as JSON).
NOT_NEEDED = ("flask", "jinja2", "werkzeug", "ldap3", "mitmproxy.addons.onboarding", "mitmproxy.addons.proxyauth",
              "mitmproxy.addons.clientplayback", "mitmproxy.addons.maplocal", "mitmproxy.io", "mitmproxy.flowfilter",
              "yaml")


def run(code: str) -> dict:
    script = f"import sys, json\n{code}\n"
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_sidecar_loads_only_the_mitmproxy_addons_it_runs() -> None:
    doc = run("import tether.proxy.sidecar as s\nnames = [type(a).__name__ for a in s.mitmproxy_addons()]\n"
              "print(json.dumps({'names': names, 'modules': sorted(sys.modules)}))")
    assert doc["names"] == ["Core", "Block", "DisableH2C", "Proxyserver", "DnsResolver", "NextLayer", "TlsConfig"]
    loaded = [m for m in doc["modules"] if m in NOT_NEEDED or m.split(".")[0] in NOT_NEEDED]
    assert loaded == [], loaded


def test_mitmproxys_default_set_still_loads_when_asked_for() -> None:
    doc = run("import tether.proxy.sidecar\nfrom mitmproxy.addons import default_addons, savehar\n"
              "import mitmproxy.addons as package\n"
              "print(json.dumps({'n': len(default_addons()), 'har': savehar.SaveHar.__name__,"
              " 'same': package is sys.modules['mitmproxy.addons'], 'flask': 'flask' in sys.modules}))")
    assert doc == {"n": 31, "har": "SaveHar", "same": True, "flask": True}
