"""Modules mitmproxy imports that a sidecar never uses, registered without running their bodies.

A module registered by ``defer`` is in ``sys.modules`` as a bare module (its spec, file and path set, its body not
run); its body runs, once, at the first read of any attribute the bare module lacks, as ``import`` would have run
it, so whatever uses it later gets the real module. Deferred (from ``tether/proxy/__init__.py``, before any of
mitmproxy is imported; ``command_lexer`` from ``proxy/mitmaddons.py``, before ``mitmproxy.command``):

- ``pyparsing`` (and through it ``unittest``, ``difflib``, ``pprint``): ``mitmproxy.command`` imports it and
  ``mitmproxy.command_lexer`` builds a grammar with it at import, for command strings typed at mitmproxy's console;
  ``command_lexer.quote`` and ``unquote``, which ``mitmproxy.command`` imports by name, load the module when called;
- ``ruamel.yaml``: ``mitmproxy.optmanager`` imports it for options files, which a sidecar does not read.

Together ~5-6 MiB of every sidecar's resident memory (bench/RESULTS.md, "Idle RSS"). ``importlib.util.LazyLoader``
cannot do this: the import statement itself reads ``__spec__`` of a module found in ``sys.modules``, which runs a
lazy module's body at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType


def defer(name: str, by_name: tuple[str, ...] = ()) -> None:
    """Register module ``name`` without running its body: it runs, once, at the first read of any attribute the
    bare module lacks (as ``import`` would have run it). ``by_name``: functions another module imports from it by
    name (``from M import f``, a read at import), given as stand-ins that load the module when called."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:  # not installed: nothing to defer
        return
    module = importlib.util.module_from_spec(spec)
    loader, lock = spec.loader, threading.Lock()

    def load() -> ModuleType:
        with lock:
            if "__getattr__" in module.__dict__:  # not run yet
                del module.__getattr__
                for attr in by_name:
                    del module.__dict__[attr]
                try:
                    loader.exec_module(module)
                except BaseException:  # as a failed import: not left half-made in sys.modules
                    sys.modules.pop(name, None)
                    raise
        return module

    def __getattr__(attr: str) -> object:  # PEP 562: only what the bare module lacks
        if attr == "__path__":  # the import system asking whether a module is a package: the spec knows
            raise AttributeError(attr)
        return getattr(load(), attr)

    def stand_in(attr: str) -> object:
        def call(*args: object, **kwargs: object) -> object:
            return getattr(load(), attr)(*args, **kwargs)
        call.__name__ = call.__qualname__ = attr
        return call

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    for attr in by_name:
        setattr(module, attr, stand_in(attr))
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(importlib.import_module(parent), child, module)


defer("pyparsing")
defer("ruamel.yaml")
# mitmproxy.command_lexer is deferred by proxy/mitmaddons.py, before it imports mitmproxy.command: finding a
# submodule imports its package, and importing tether.proxy must load no mitmproxy (tests/test_cli_errors.py).
