"""The sidecar's secrets as ``--secret`` names them (``NAME=env:VAR`` or ``NAME=file:PATH``): parsed, and read.

Kept apart from tether/proxy/credentials.py (which injects them) so that ``tether run`` can check its ``--secret``
options without importing the proxy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tether.capability.errors import BAD_REQUEST, TetherError


@dataclass(frozen=True)
class SecretSpec:
    name: str
    kind: str  # "env" | "file"
    ref: str

    @classmethod
    def parse(cls, text: str) -> SecretSpec:
        name, sep, source = text.partition("=")
        kind, sep2, ref = source.partition(":")
        if not sep or not sep2 or not name or not ref or kind not in ("env", "file"):
            raise TetherError(f"--secret {text.split('=', 1)[0]}=...: expected NAME=env:VAR or NAME=file:PATH",
                              code=BAD_REQUEST)
        return cls(name, kind, ref)


def load_secrets(specs: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Read every ``--secret``. A named source that is missing or empty is an error: the operator meant it."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for text in specs:
        spec = SecretSpec.parse(text)
        if spec.kind == "env":
            value = environ.get(spec.ref)
            if value is None:
                raise TetherError(f"--secret {spec.name}: the environment variable {spec.ref} is not set",
                                  code=BAD_REQUEST)
        else:
            try:
                value = Path(spec.ref).read_text()
            except OSError as exc:
                raise TetherError(f"--secret {spec.name}: cannot read {spec.ref}: {exc.strerror}",
                                  code=BAD_REQUEST) from None
            value = value.rstrip("\r\n")
        if not value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise TetherError(f"--secret {spec.name}: the value is empty or holds control characters "
                              "(it must fit in one header line)", code=BAD_REQUEST)
        out[spec.name] = value
    return out
