"""The catalog's path-glob language: matching a path, and inclusion between two globs, in polynomial time.

The language (see ``kinds/http.py``'s ``HttpMatch``): ``*`` matches any run of characters, ``/`` included; every other
character is literal. ``admits(glob, path)`` is the matcher the sidecar runs. ``included(new, old)`` answers
whether every string ``new`` admits is also admitted by ``old``; ``witness(new, old)`` gives a string ``new``
admits and ``old`` refuses (a shortest one, unless the search's budget ran out) or None when there is none.
The release gate uses them so that ``/public/*`` -> ``/*`` is a widening and ``/repos/*`` ->
``/repos/*/issues`` is not, whatever the spelling. Nothing here is exponential in the globs: an earlier
version walked the product of both subset constructions, and a 4 KB surface took 20 s (issue: glob blow-up).

Matching (``admits``). Write a glob as ``t0*t1*...*tm``. With no star it admits only ``t0``. Otherwise a
path matches iff it starts with ``t0``, ends with ``tm``, is at least ``|t0|+|tm|`` long, and the middle
(between the two) holds ``t1, ..., t(m-1)`` in order without overlap. Taking each middle segment at its
leftmost occurrence after the previous one is enough (any embedding can be shifted left onto the greedy one),
so one ``str.find`` per segment decides it: O(|path| * |glob|) at worst, no backtracking.

Inclusion (``included``). Let ``c`` be a character ``old`` does not write, and ``u`` be ``new`` with every
star replaced by ``c``. Then ``new`` is included in ``old`` iff ``old`` admits ``u``. Only if: ``u`` is in
``new``. If: in a match of ``old`` against ``u`` every ``c`` lies inside a run some star of ``old`` covers
(no literal of ``old`` is ``c``); any string ``new`` admits is ``u`` with each ``c`` replaced by some run,
and the same stars of ``old`` cover those runs instead. So inclusion is one match: O(|new| * |old|).

A shortest witness (``witness``). When ``new`` is not included, ``u`` above is a real witness, but usually a
long one; ``tether audit diff`` prints the shortest. ``old`` (with a star) refuses a string ``s`` iff one of:
  A. ``s`` does not start with ``t0``;  B. ``s`` does not end with ``tm``;  C. ``|s| < |t0|+|tm|``;
  D. ``s = t0 x tm`` and the greedy embedding of ``t1..t(m-1)`` into ``x`` does not complete.
(If none holds, ``s`` is admitted: that is the matching rule above.) Each is recognised by a small
automaton with one state per literal of ``old``, at most: A tracks how much of ``t0`` was read, B is the
KMP automaton of ``tm``, C counts, D reads ``t0``, then runs the greedy embedding deterministically (segment
index, KMP state within it), then guesses where ``tm`` starts and reads it. ``old`` with no star refuses
``s`` iff ``s != t0`` (one automaton of ``|t0|+2`` states). The union R of these has at most
``3*|old| + 4`` states, and its language is exactly what ``old`` refuses. A breadth-first search of
``new``'s position automaton (one state per token) times R, over one character per distinct transition
(each character ``old`` writes, and one character neither glob writes standing for all the others), finds
a shortest string in both: a shortest witness. It visits at most ``(|new|+1) * (3*|old|+4)`` states
(``bound``), a polynomial; a ``Budget`` shared by a whole diff caps it anyway, and when that runs out the
answer falls back to ``u`` (real, not shortest).

The question is asked over all strings, not only over paths tether would forward (``safe_path`` refuses
dot segments and encoded slashes first): a difference that only such a path could show is still reported.
That errs towards calling a change a widening, never towards missing one. Globs longer than ``MAX_GLOB``
(the catalog refuses them) are not compared at all: ``GlobTooLong``, which the gate counts as a widening.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

MAX_GLOB = 1024  # the longest path glob a catalog may write (catalog.py refuses longer ones)
DEFAULT_STEPS = 500_000  # search states one diff may visit before witnesses fall back to ``u``
_SPARE = "xqz0-_~aA"  # candidates for the character that stands for all those neither glob names


class GlobTooLong(ValueError):
    """A glob longer than ``MAX_GLOB``: not compared (a surface the catalog could not have produced)."""


class Budget:
    """Search states left for one diff (shared by all its path comparisons), so a hostile document of many
    glob pairs costs at most ``steps`` states in all, then only the polynomial inclusion checks."""

    def __init__(self, steps: int = DEFAULT_STEPS) -> None:
        self.left = steps


@dataclass(frozen=True)
class Verdict:
    included: bool
    example: str | None  # admitted by new, refused by old; None when included
    shortest: bool  # the example is a shortest one (False: the budget ran out, it is ``u``)
    visited: int  # search states visited (0 when included: no search)


# -- matching --------------------------------------------------------------------------------------------------
def admits(glob: str, path: str) -> bool:
    """True when ``glob`` admits ``path`` (``*`` any run of characters, the rest literal): greedy, no regex."""
    parts = glob.split("*")
    if len(parts) == 1:
        return path == glob
    first, *middle, last = parts
    if len(path) < len(first) + len(last) or not path.startswith(first) or not path.endswith(last):
        return False
    pos, end = len(first), len(path) - len(last)
    for part in middle:
        at = path.find(part, pos, end)
        if at < 0:
            return False
        pos = at + len(part)
    return True


def _check(*globs: str) -> None:
    for glob in globs:
        if len(glob) > MAX_GLOB:
            raise GlobTooLong(f"a path glob of {len(glob)} characters (at most {MAX_GLOB} are compared)")


def _spare(named: set[str]) -> str:
    spare = next((ch for ch in _SPARE if ch not in named), None)
    if spare is None:  # every candidate is written in a glob: take the first unused code point
        spare = next(chr(c) for c in range(0x100, 0x110000) if chr(c) not in named)
    return spare


def included(new: str, old: str) -> bool:
    """True when every string the glob ``new`` admits is admitted by ``old`` (``new`` is no wider)."""
    _check(new, old)
    return new == old or admits(old, new.replace("*", _spare(set(old))))


# -- what ``old`` refuses, as an automaton -----------------------------------------------------------------------
def _segments(glob: str) -> list[str]:
    """``t0, ..., tm``; consecutive stars are one star, so middle segments are never empty."""
    parts = glob.split("*")
    if len(parts) <= 2:
        return parts
    return [parts[0], *(p for p in parts[1:-1] if p), parts[-1]]


class _Kmp:
    """The KMP automaton of one literal segment: state k = the longest suffix read that is a prefix of it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.fail = [0] * (len(text) + 1)
        k = 0
        for i in range(1, len(text)):
            while k and text[i] != text[k]:
                k = self.fail[k]
            if text[i] == text[k]:
                k += 1
            self.fail[i + 1] = k

    def step(self, k: int, ch: str) -> int:
        while k and (k == len(self.text) or self.text[k] != ch):
            k = self.fail[k]
        return k + 1 if k < len(self.text) and self.text[k] == ch else 0

    def chars(self, k: int) -> set[str]:
        """The characters that lead from ``k`` anywhere but state 0 (all others act alike)."""
        out = set()
        while True:
            if k < len(self.text):
                out.add(self.text[k])
            if k == 0:
                return out
            k = self.fail[k]


_R = tuple  # an R state: a tag and its counters (see the module docstring for A, B, C, P/X/Q, E)


class _Refusal:
    """The NFA R of the strings ``old`` refuses, built from its segments; ``None`` stands for a dead state."""

    def __init__(self, old: str) -> None:
        seg = _segments(old)
        self.starless = len(seg) == 1
        self.t0, self.tm = seg[0], seg[-1]
        self.mid = [_Kmp(t) for t in seg[1:-1]]
        self.tail = _Kmp(self.tm)
        self.short = len(self.t0) + len(self.tm)
        self._moves: dict[_R, tuple[dict[str, _R | None], _R | None]] = {}

    def starts(self) -> list[_R]:
        if self.starless:
            return [("E", 0)]
        out: list[_R] = [("B", 0), ("P", 0)]
        if self.t0:
            out.append(("A", 0))
        if self.short:
            out.append(("C", 0))
        return out

    def closure(self, r: _R) -> list[_R]:
        """``r`` and the states reachable from it without reading: the guesses D makes."""
        if r[0] == "P" and r[1] == len(self.t0):
            return [r] + (self.closure(("X", 0, 0)) if self.mid else [])  # no middle: D is empty
        if r[0] == "X":
            return [r, ("Q", 0)]
        return [r]

    def accepts(self, r: _R) -> bool:
        tag = r[0]
        if tag in ("A", "A!", "C", "E!"):
            return True
        if tag == "B":
            return r[1] != len(self.tm)
        if tag == "Q":
            return r[1] == len(self.tm)
        if tag == "E":
            return r[1] != len(self.t0)
        return False

    def _step(self, r: _R, ch: str | None) -> _R | None:
        """One character; ``None`` for ch is any character ``old`` does not write."""
        tag = r[0]
        if tag == "A":
            if ch == self.t0[r[1]]:
                return ("A", r[1] + 1) if r[1] + 1 < len(self.t0) else None
            return ("A!",)
        if tag in ("A!", "E!"):
            return r
        if tag == "B":
            return ("B", self.tail.step(r[1], ch or ""))
        if tag == "C":
            return ("C", r[1] + 1) if r[1] + 1 < self.short else None
        if tag == "P":
            return ("P", r[1] + 1) if r[1] < len(self.t0) and ch == self.t0[r[1]] else None
        if tag == "X":
            i, k = r[1], self.mid[r[1]].step(r[2], ch or "")
            if k < len(self.mid[i].text):
                return ("X", i, k)
            return ("X", i + 1, 0) if i + 1 < len(self.mid) else None  # embedded: ``old`` admits, D dead
        if tag == "Q":
            return ("Q", r[1] + 1) if r[1] < len(self.tm) and ch == self.tm[r[1]] else None
        # "E": old without a star refuses everything but t0
        return ("E", r[1] + 1) if r[1] < len(self.t0) and ch == self.t0[r[1]] else ("E!",)

    def moves(self, r: _R) -> tuple[dict[str, _R | None], _R | None]:
        """(character -> next state for each character that matters here, next state on any other)."""
        got = self._moves.get(r)
        if got is None:
            tag = r[0]
            if tag in ("A", "P", "Q", "E"):
                text = self.tm if tag == "Q" else self.t0
                named = {text[r[1]]} if r[1] < len(text) else set()
            elif tag == "B":
                named = self.tail.chars(r[1])
            elif tag == "X":
                named = self.mid[r[1]].chars(r[2])
            else:
                named = set()
            got = ({ch: self._step(r, ch) for ch in sorted(named)}, self._step(r, None))
            self._moves[r] = got
        return got


def bound(new: str, old: str) -> int:
    """The most states the witness search can visit: (positions of ``new``) * (states of R)."""
    return (len(new) + 1) * (3 * len(old) + 4)


# -- the search -------------------------------------------------------------------------------------------------
def compare(new: str, old: str, budget: Budget | None = None) -> Verdict:
    """Inclusion and, when ``new`` admits more, a witness: shortest unless ``budget`` runs out first."""
    _check(new, old)
    spare = _spare(set(new) | set(old))
    fresh = new.replace("*", spare)
    if new == old or admits(old, fresh):
        return Verdict(True, None, True, 0)
    budget = budget if budget is not None else Budget()
    tokens = [ch for i, ch in enumerate(new) if ch != "*" or i == 0 or new[i - 1] != "*"]  # "**" is "*"
    end = len(tokens)
    refusal = _Refusal(old)

    def positions(p: int) -> Iterator[int]:  # p, and the position after a star, which may match nothing
        yield p
        if p < end and tokens[p] == "*":
            yield p + 1

    State = tuple[int, _R]
    parent: dict[State, tuple[State, str] | None] = {}
    queue: deque[State] = deque()

    def visit(p: int, rs: list[_R], link: tuple[State, str] | None) -> None:
        for q in positions(p):
            for r in rs:
                for c in refusal.closure(r):
                    if (q, c) not in parent:
                        parent[q, c] = link
                        queue.append((q, c))

    visit(0, refusal.starts(), None)
    visited = 0
    while queue:
        state = queue.popleft()
        visited += 1
        budget.left -= 1
        if budget.left < 0:
            return Verdict(False, fresh, False, visited)  # real (``old`` refuses it: not included), not shortest
        p, r = state
        if p == end:
            if refusal.accepts(r):
                chars: list[str] = []
                cursor = state
                while (link := parent[cursor]) is not None:
                    cursor, ch = link
                    chars.append(ch)
                return Verdict(False, "".join(reversed(chars)), True, visited)
            continue
        named, other = refusal.moves(r)
        if tokens[p] == "*":  # any character: one per distinct move of R, then one for all the rest
            for ch, nxt in named.items():
                if nxt is not None:
                    visit(p, [nxt], (state, ch))
            if other is not None:
                visit(p, [other], (state, spare))
        else:
            ch = tokens[p]
            nxt = named[ch] if ch in named else other
            if nxt is not None:
                visit(p + 1, [nxt], (state, ch))
    raise AssertionError(f"{new!r} is not included in {old!r} (it admits {fresh!r}), yet no witness was found")


def witness(new: str, old: str, budget: Budget | None = None) -> str | None:
    """A string ``new`` admits and ``old`` refuses (shortest unless the budget ran out), or None."""
    return compare(new, old, budget).example
