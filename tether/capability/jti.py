"""Naming a link by its jti or by a unique prefix of it, as people copy one from a listing.

A jti is 32 hex characters (``chain.new_jti``). Wherever a jti is taken (``tether revoke``, ``tether budgets
--jti``, ``grant verify --revoked``, ``POST /v1/grants/{jti}/revoke``, ``GET /v1/budgets/{jti}``) a prefix of at
least ``MIN_PREFIX`` hex characters names the one link it begins, and is refused when it begins several
(``tether.jti_ambiguous``, naming them) or none. Pure: the caller looks the candidates up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import BAD_REQUEST, JTI_AMBIGUOUS, NOT_FOUND, ApiError

MIN_PREFIX = 8
FULL = 32
_HEX = re.compile(r"[0-9a-f]+")
SHOWN = 12  # what listings print of a jti: a prefix every jti-taking command accepts


def normalize(text: str) -> str:
    """The jti or prefix as typed, with what a copy from a listing brings along removed (spaces, a trailing
    ellipsis), lower-cased."""
    return text.strip().rstrip("…").rstrip(".").strip().lower()


def is_prefix(text: str) -> bool:
    """Whether ``text`` (normalized) is a shortened jti this module resolves, rather than a whole one."""
    return MIN_PREFIX <= len(text) < FULL and bool(_HEX.fullmatch(text))


def check_prefix(text: str) -> str:
    """``text`` normalized, or a ``tether.bad_request`` saying how a link is named."""
    given = normalize(text)
    if len(given) == FULL or is_prefix(given):
        return given
    if not given or not _HEX.fullmatch(given) or len(given) > FULL:
        raise ApiError(400, BAD_REQUEST, f"{text!r} is not a jti: a jti is {FULL} hex characters (or a unique "
                       f"prefix of at least {MIN_PREFIX})", field="jti")
    raise ApiError(400, BAD_REQUEST, f"jti prefix {text!r} is too short: give at least {MIN_PREFIX} hex characters",
                   field="jti")


def resolve(text: str, candidates: Iterable[str]) -> str:
    """The one jti among ``candidates`` that ``text`` names: itself, or the only one it begins.

    Raises ``tether.bad_request`` (400) for what cannot name a link, ``tether.not_found`` (404) when nothing
    matches, and ``tether.jti_ambiguous`` (409, listing the matches) when several do."""
    given = check_prefix(text)
    matches = sorted({c for c in candidates if c == given or c.startswith(given)})
    if given in matches:
        return given
    if not matches:
        raise ApiError(404, NOT_FOUND, f"no registered link has jti {given}"
                       + (" or one beginning with it" if len(given) < FULL else ""))
    if len(matches) > 1:
        shown = ", ".join(matches[:5]) + (f" and {len(matches) - 5} more" if len(matches) > 5 else "")
        raise ApiError(409, JTI_AMBIGUOUS, f"jti prefix {given} begins {len(matches)} links' jtis ({shown}): give "
                       "more characters", matches=matches[:20])
    return matches[0]


def shown(jti: str) -> str:
    """A jti as a listing prints it: its first ``SHOWN`` characters, which every jti-taking command accepts."""
    return jti[:SHOWN]
