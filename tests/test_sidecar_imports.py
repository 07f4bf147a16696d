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
# Imported by mitmproxy, their bodies deferred until something reads them (tether/proxy/deferred.py): a submodule
# each loads when its body runs.
DEFERRED = ("pyparsing.core", "unittest", "ruamel.yaml.main", "aiohttp", "jwt")


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
    assert [m for m in DEFERRED if m in doc["modules"]] == []


def test_a_sidecar_process_loads_no_other_commands_module() -> None:
    doc = run("import tether.cli.main as c\nc.build_parser('sidecar')\nimport tether.proxy.sidecar\n"
              "print(json.dumps({'modules': sorted(sys.modules)}))")
    commands = [m for m in doc["modules"] if m.startswith("tether.cli.")]
    assert commands == ["tether.cli.main", "tether.cli.process", "tether.cli.remote", "tether.cli.sidecar"], commands


def test_what_is_deferred_still_works_when_it_is_used() -> None:
    # mitmproxy's command strings (pyparsing's grammar), its options files (ruamel.yaml) and its flow filters, in a
    # process that loaded the sidecar first: each module's body runs at its first use, once.
    doc = run("import tether.proxy.sidecar, io\nfrom mitmproxy import command, command_lexer, optmanager, options\n"
              "deferred = 'pyparsing.core' not in sys.modules and 'ruamel.yaml.main' not in sys.modules\n"
              "parts = [str(p) for p in command_lexer.expr.parse_string('a \"b c\"')]\n"
              "opts = options.Options()\noptmanager.load(opts, 'listen_port: 8123\\n')\n"
              "from mitmproxy import flowfilter\n"
              "print(json.dumps({'deferred': deferred, 'parts': parts, 'unquoted': command.unquote(\"'x y'\"),"
              " 'quoted': command_lexer.quote('x y'), 'port': opts.listen_port,"
              " 'filter': flowfilter.parse('~q') is not None, 'same': sys.modules['pyparsing'].Word.__module__}))")
    assert doc == {"deferred": True, "parts": ["a", " ", '"b c"'], "unquoted": "x y", "quoted": '"x y"',
                   "port": 8123, "filter": True, "same": "pyparsing.core"}


def test_mitmproxys_default_set_still_loads_when_asked_for() -> None:
    doc = run("import tether.proxy.sidecar\nfrom mitmproxy.addons import default_addons, savehar\n"
              "import mitmproxy.addons as package\n"
              "print(json.dumps({'n': len(default_addons()), 'har': savehar.SaveHar.__name__,"
              " 'same': package is sys.modules['mitmproxy.addons'], 'flask': 'flask' in sys.modules}))")
    assert doc == {"n": 31, "har": "SaveHar", "same": True, "flask": True}
