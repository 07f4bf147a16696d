"""mitmproxy's Master and the addon modules a sidecar runs, loaded without the rest of mitmproxy's default set.

``mitmproxy/addons/__init__.py`` imports all 31 default addons to build ``default_addons()``: Flask and
Jinja for the onboarding app, ldap3 for proxy authentication, pyparsing for flow filters, and more. A
sidecar runs 7 of them (``proxy.sidecar.mitmproxy_addons()``), and that package body alone was ~16 MiB of
every sidecar's resident memory. So the package is registered without running its body, and only the
submodules asked for are imported. Anything else read from the package (``default_addons``, an addon
imported as ``from mitmproxy.addons import x``) still works: the package body then runs, once, as usual.

Import ``Master`` from here too: ``mitmproxy.master`` imports ``.addons.termlog``, so importing it before this
module would run the whole package body.

pyparsing, ``mitmproxy.command_lexer`` and ruamel.yaml are deferred likewise (``tether/proxy/deferred.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

import mitmproxy

from .deferred import defer

PACKAGE = "mitmproxy.addons"


def _register_bare_package() -> None:
    if PACKAGE in sys.modules:  # already imported (in full, or bare by an earlier call)
        return
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)  # __path__ set, body not run

    def __getattr__(name: str) -> ModuleType | object:  # PEP 562: what the bare package lacks
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:  # a submodule: only that one
            return importlib.import_module(f"{PACKAGE}.{name}")
        del package.__getattr__  # anything else: the real package body, which defines it
        spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[PACKAGE] = package
    mitmproxy.addons = package  # type: ignore[attr-defined]


_register_bare_package()
defer("mitmproxy.command_lexer", by_name=("quote", "unquote"))  # before addons.core imports mitmproxy.command

block = importlib.import_module(f"{PACKAGE}.block")
core = importlib.import_module(f"{PACKAGE}.core")
disable_h2c = importlib.import_module(f"{PACKAGE}.disable_h2c")
dns_resolver = importlib.import_module(f"{PACKAGE}.dns_resolver")
next_layer = importlib.import_module(f"{PACKAGE}.next_layer")
proxyserver = importlib.import_module(f"{PACKAGE}.proxyserver")
tlsconfig = importlib.import_module(f"{PACKAGE}.tlsconfig")
Master = importlib.import_module("mitmproxy.master").Master
