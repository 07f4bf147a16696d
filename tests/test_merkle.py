"""The record log's Merkle tree against a brute-force one: roots, inclusion and consistency proofs of every
size and index up to a bound (and random ones beyond), and no proof verifying for anything it does not prove."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.controlplane.merkle import (
    EMPTY_ROOT,
    ProofError,
    Tree,
    leaf_hash,
    node_hash,
    record_leaf,
    verify_consistency,
    verify_inclusion,
)

BOUND = 33  # every size and index up to here, with tampered variants: powers of two, one past them, the sizes between
PAIRS = 256  # every pair of sizes (and every index) up to here, proofs checked


def leaves(n: int) -> list[bytes]:
    return [leaf_hash(f"record {i}".encode()) for i in range(n)]


def brute_root(hashes: list[bytes]) -> bytes:
    """MTH straight from the RFC's definition, with no caching and no index arithmetic."""
    if not hashes:
        return EMPTY_ROOT
    if len(hashes) == 1:
        return hashes[0]
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    return node_hash(brute_root(hashes[:k]), brute_root(hashes[k:]))


def test_the_known_answers_of_rfc_6962_shape() -> None:
    assert EMPTY_ROOT == hashlib.sha256(b"").digest()
    assert leaf_hash(b"") == hashlib.sha256(b"\x00").digest()
    a, b, c = leaves(3)
    assert Tree([a, b, c]).root() == node_hash(node_hash(a, b), c)
    assert record_leaf("sha256:ab") == hashlib.sha256(b"\x00sha256:ab").digest()


def test_every_root_and_inclusion_proof_up_to_the_bound() -> None:
    hashes = leaves(BOUND)
    tree = Tree(hashes)
    for size in range(BOUND + 1):
        root = tree.root(size)
        assert root == brute_root(hashes[:size])
        for index in range(size):
            proof = tree.inclusion_proof(index, size)
            assert verify_inclusion(hashes[index], index, size, proof, root)
            assert not verify_inclusion(leaf_hash(b"not in the log"), index, size, proof, root)
            if size > 1:
                assert not verify_inclusion(hashes[index], (index + 1) % size, size, proof, root)
            if size < BOUND:  # the root binds the size: the same path against the next tree's root fails
                assert not verify_inclusion(hashes[index], index, size + 1, proof, tree.root(size + 1))
            if proof:
                assert not verify_inclusion(hashes[index], index, size, proof[:-1], root)
                assert not verify_inclusion(hashes[index], index, size, [*proof, root], root)


def test_every_consistency_proof_up_to_the_bound() -> None:
    hashes = leaves(BOUND)
    tree = Tree(hashes)
    for second in range(1, BOUND + 1):
        for first in range(1, second + 1):
            proof = tree.consistency_proof(first, second)
            r1, r2 = tree.root(first), tree.root(second)
            assert verify_consistency(first, second, r1, r2, proof), (first, second)
            if first < second:
                other = Tree([*hashes[: first - 1], leaf_hash(b"rewritten"), *hashes[first:]])
                assert not verify_consistency(first, second, other.root(first), r2, proof)  # a rewritten past
                assert not verify_consistency(first, second, r1, other.root(second), proof)  # a fork
                if proof:
                    assert not verify_consistency(first, second, r1, r2, proof[:-1])
                    if second < BOUND:
                        assert not verify_consistency(first, second + 1, r1, tree.root(second + 1), proof)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.data())
def test_random_sizes_beyond_the_bound(size: int, data: st.DataObject) -> None:
    hashes = leaves(size)
    tree = Tree(hashes)
    index = data.draw(st.integers(0, size - 1))
    first = data.draw(st.integers(1, size))
    assert verify_inclusion(hashes[index], index, size, tree.inclusion_proof(index), tree.root())
    assert verify_consistency(first, size, tree.root(first), tree.root(), tree.consistency_proof(first))
    tampered = data.draw(st.integers(0, size - 1))
    forged = Tree([*hashes[:tampered], leaf_hash(b"x"), *hashes[tampered + 1:]])
    assert forged.root() != tree.root()
    if tampered < first:
        assert not verify_consistency(first, size, forged.root(first), tree.root(), tree.consistency_proof(first))


def test_proofs_of_what_the_tree_does_not_hold_are_refused() -> None:
    tree = Tree(leaves(5))
    with pytest.raises(ProofError):
        tree.inclusion_proof(5)
    with pytest.raises(ProofError):
        tree.consistency_proof(0, 5)
    with pytest.raises(ProofError):
        tree.consistency_proof(3, 6)
    with pytest.raises(ProofError):
        tree.root(6)
    assert verify_consistency(0, 5, EMPTY_ROOT, tree.root(), [])
    assert not verify_consistency(3, 2, tree.root(3), tree.root(2), [])
    assert not verify_inclusion(tree.leaves[0], 0, 0, [], EMPTY_ROOT)


def test_a_tree_extended_leaf_by_leaf_has_the_roots_and_proofs_of_one_built_at_once() -> None:
    hashes = leaves(70)
    grown = Tree(hashes[:1])
    for n in range(2, 71):
        grown.root()  # fills the cache at every size on the way
        grown.extend(hashes[n - 1:n])
        whole = Tree(hashes[:n])
        assert grown.root() == whole.root() == brute_root(hashes[:n])
        assert grown.consistency_proof(n // 2 or 1) == whole.consistency_proof(n // 2 or 1)
        assert grown.inclusion_proof(n - 1) == whole.inclusion_proof(n - 1)


def test_every_pair_of_sizes_up_to_a_few_hundred() -> None:
    hashes = leaves(PAIRS)
    tree = Tree(hashes)
    roots = [tree.root(n) for n in range(PAIRS + 1)]
    for second in range(1, PAIRS + 1):
        for index in range(second):
            assert verify_inclusion(hashes[index], index, second, tree.inclusion_proof(index, second), roots[second])
        for first in range(1, second + 1):
            assert verify_consistency(first, second, roots[first], roots[second], tree.consistency_proof(first, second))
