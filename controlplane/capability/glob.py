"""Inclusion between path globs of the catalog's glob language, decided exactly.

The language (see ``catalog.HttpMatch``): ``*`` matches any run of characters, ``/`` included; every
other character is literal. ``included(new, old)`` answers whether every string ``new`` admits is also
admitted by ``old``, and ``witness(new, old)`` gives a shortest string ``new`` admits and ``old`` refuses
(None when there is none). The release gate uses it so that ``/public/*`` -> ``/*`` is a widening and
``/repos/*`` -> ``/repos/*/issues`` is not, whatever the spelling.

How: each glob is a small NFA (one state per position, ``*`` a self-loop that may also be skipped). We
walk the product of both subset constructions, breadth first, looking for a state where ``new`` accepts
and ``old`` does not; the path there spells a shortest witness. Characters are grouped into classes: each
character written in either glob is its own class, and one character written in neither stands for all
the others (both automata treat those alike). The reachable subsets of a star-and-literal NFA are few (a
star, once reached, stays reached), so the walk is small for globs of catalog size.

The question is asked over all strings, not only over paths tether would forward (``safe_path`` refuses
dot segments and encoded slashes first): a difference that only such a path could show is still reported.
That errs towards calling a change a widening, never towards missing one.
"""

from __future__ import annotations

from collections import deque

STAR = None  # a token of a parsed glob: a literal character, or STAR
_State = tuple[frozenset[int], frozenset[int]]  # where new, and where old, can be after one string
_SPARE = "xqz0-_~aA"  # candidates for the character that stands for all those neither glob names


def _tokens(glob: str) -> tuple[str | None, ...]:
    return tuple(STAR if ch == "*" else ch for ch in glob)


def _closure(tokens: tuple[str | None, ...], states: frozenset[int] | set[int]) -> frozenset[int]:
    """States reachable by skipping stars (a star may match the empty run)."""
    out = set(states)
    stack = list(states)
    while stack:
        i = stack.pop()
        if i < len(tokens) and tokens[i] is STAR and i + 1 not in out:
            out.add(i + 1)
            stack.append(i + 1)
    return frozenset(out)


def _step(tokens: tuple[str | None, ...], states: frozenset[int], ch: str) -> frozenset[int]:
    nxt: set[int] = set()
    for i in states:
        if i < len(tokens):
            if tokens[i] is STAR:
                nxt.add(i)
            elif tokens[i] == ch:
                nxt.add(i + 1)
    return _closure(tokens, nxt)


def witness(new: str, old: str) -> str | None:
    """A shortest string that ``new`` admits and ``old`` refuses, or None when ``new`` admits nothing more."""
    n_tok, o_tok = _tokens(new), _tokens(old)
    named = {ch for ch in new + old if ch != "*"}
    spare = next((ch for ch in _SPARE if ch not in named), None)
    if spare is None:  # every candidate is written in a glob: take the first unused code point
        spare = next(chr(c) for c in range(0x100, 0x110000) if chr(c) not in named)
    alphabet = [*sorted(named), spare]
    start = (_closure(n_tok, {0}), _closure(o_tok, {0}))
    parent: dict[_State, tuple[_State, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        n_set, o_set = state
        if len(n_tok) in n_set and len(o_tok) not in o_set:
            chars: list[str] = []
            cursor = state
            while (link := parent[cursor]) is not None:
                cursor, ch = link
                chars.append(ch)
            return "".join(reversed(chars))
        for ch in alphabet:
            n_next = _step(n_tok, n_set, ch)
            if not n_next:
                continue  # ``new`` admits nothing going this way
            nxt = (n_next, _step(o_tok, o_set, ch))
            if nxt not in parent:
                parent[nxt] = (state, ch)
                queue.append(nxt)
    return None


def included(new: str, old: str) -> bool:
    """True when every string the glob ``new`` admits is admitted by ``old`` (``new`` is no wider)."""
    return new == old or witness(new, old) is None
