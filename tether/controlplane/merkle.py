"""The record log as a Merkle tree in the shape of RFC 9162 (Certificate Transparency 2.0, section 2.1):
leaf and node hashes, the tree head, inclusion proofs and consistency proofs, and their verification.

Pure functions over lists of leaf hashes. A record's leaf is the SHA-256 of ``0x00 || its "hash" field``
(the record's own hash already commits to every other field), so the tree can be built from the log as
written, records written before the tree included.

The algorithms are the RFC's: ``root`` is MTH, ``inclusion_proof`` is PATH, ``consistency_proof`` is PROOF,
and the two ``verify_*`` functions follow sections 2.1.3.2 and 2.1.4.2 step by step. tests/test_merkle.py
holds them to a brute-force tree over every size and index up to a bound, and to random ones beyond it.
Why not a library: pymerkle (the maintained Python one) has proofs in its own layout, not the RFC's list of
hashes, and the C2SP witness protocol needs the RFC's consistency proofs byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

LEAF, NODE = b"\x00", b"\x01"
EMPTY_ROOT = hashlib.sha256(b"").digest()


class ProofError(ValueError):
    """A proof asked for sizes or indexes the tree does not have."""


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(LEAF + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE + left + right).digest()


def record_leaf(record_hash: str) -> bytes:
    """A record's leaf: the hash of its ``hash`` field's text (``sha256:…``)."""
    return leaf_hash(record_hash.encode("ascii"))


def _split(n: int) -> int:
    """The largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


class Tree:
    """Leaf hashes and the roots of their subtrees (each range computed once)."""

    def __init__(self, leaves: Sequence[bytes]) -> None:
        self.leaves = list(leaves)
        self._root = lru_cache(maxsize=None)(self._root_uncached)

    def extend(self, leaves: Sequence[bytes]) -> None:
        """Append leaves. Subtree roots already computed stay valid (a range of old leaves never changes), so
        the next root costs the new leaves and a logarithm of hashes, not the whole tree again."""
        self.leaves.extend(leaves)

    @property
    def size(self) -> int:
        return len(self.leaves)

    def root(self, size: int | None = None) -> bytes:
        """MTH of the first ``size`` leaves (all of them by default)."""
        size = self.size if size is None else size
        if not 0 <= size <= self.size:
            raise ProofError(f"the tree has {self.size} leaves, not {size}")
        return EMPTY_ROOT if size == 0 else self._root(0, size)

    def _root_uncached(self, start: int, end: int) -> bytes:
        if end - start == 1:
            return self.leaves[start]
        k = _split(end - start)
        return node_hash(self._root(start, start + k), self._root(start + k, end))

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """PATH(index, D[size]): the audit path of leaf ``index`` in the tree of the first ``size`` leaves."""
        size = self.size if size is None else size
        if not 0 <= index < size <= self.size:
            raise ProofError(f"no leaf {index} in a tree of {size} (the log holds {self.size})")
        return self._path(index, 0, size)

    def _path(self, m: int, start: int, end: int) -> list[bytes]:
        if end - start == 1:
            return []
        k = _split(end - start)
        if m < k:
            return [*self._path(m, start, start + k), self._root(start + k, end)]
        return [*self._path(m - k, start + k, end), self._root(start, start + k)]

    def consistency_proof(self, first: int, second: int | None = None) -> list[bytes]:
        """PROOF(first, D[second]): that the tree of ``first`` leaves is a prefix of the tree of ``second``."""
        second = self.size if second is None else second
        if not 0 < first <= second <= self.size:
            raise ProofError(f"no consistency proof from {first} to {second} (the log holds {self.size})")
        return self._subproof(first, 0, second, True)

    def _subproof(self, m: int, start: int, end: int, whole: bool) -> list[bytes]:
        n = end - start
        if m == n:
            return [] if whole else [self._root(start, end)]
        k = _split(n)
        if m <= k:
            return [*self._subproof(m, start, start + k, whole), self._root(start + k, end)]
        return [*self._subproof(m - k, start + k, end, False), self._root(start, start + k)]


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """RFC 9162 2.1.3.2: whether ``proof`` shows ``leaf`` at ``index`` in the tree of ``size`` with ``root``."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while not fn & 1 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def verify_consistency(first: int, second: int, first_root: bytes, second_root: bytes,
                       proof: Sequence[bytes]) -> bool:
    """RFC 9162 2.1.4.2: whether ``proof`` shows the tree of ``first`` (``first_root``) to be a prefix of the
    tree of ``second`` (``second_root``). From size 0 every tree is consistent (there is nothing to prove)."""
    if first == 0:
        return not proof and second >= 0
    if not 0 < first <= second:
        return False
    if first == second:
        return not proof and first_root == second_root
    path = list(proof)
    if first & (first - 1) == 0:  # an exact power of two: the first tree is a subtree of the second
        path.insert(0, first_root)
    if not path:
        return False
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while not fn & 1 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == first_root and sr == second_root and sn == 0
