"""The pure budget rules (tether/capability/budget.py, chain narrowing): by table, then by hypothesis."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import keys
from tether.capability.budget import (
    Grant,
    GrantError,
    next_want,
    parse_cap_spec,
    read_grant,
    slice_keys,
    slice_size,
    widening,
)
from tether.capability.catalog import parse_catalog
from tether.capability.chain import Verifier, mint_child, mint_root, parse_chain_unverified
from tether.capability.errors import CatalogError, ChainInvalid

CATALOG = parse_catalog("""
capabilities:
  svc.call: {http: {host: svc.example, methods: [GET], path: "/*"}}
roles:
  worker: {svc.call: {tier: direct, calls: 100, per_minute: 10}}
""")

NARROWING = [
    # parent, child, reason (None: allowed)
    (Grant("direct"), Grant("direct"), None),
    (Grant("direct"), Grant("direct", calls=5), None),  # a budget may be added
    (Grant("direct", calls=20), Grant("direct", calls=15), None),
    (Grant("direct", calls=20), Grant("direct", calls=20), None),
    (Grant("direct", calls=20), Grant("approval", calls=1), None),
    (Grant("direct", calls=20), Grant("direct", calls=21), "budget_widened"),
    (Grant("direct", calls=20), Grant("direct"), "budget_widened"),  # never removed
    (Grant("direct", calls=20), Grant("direct", per_minute=5), "budget_widened"),  # calls dropped
    (Grant("direct", per_minute=5), Grant("direct", calls=100, per_minute=5), None),
    (Grant("direct", per_minute=5), Grant("direct", per_minute=6), "budget_widened"),
    (Grant("approval", calls=3), Grant("direct", calls=3), "tier_weakened"),
    (None, Grant("direct"), "widened_capability"),
]


@pytest.mark.parametrize(("parent", "child", "reason"), NARROWING)
def test_narrowing_table(parent: Grant | None, child: Grant, reason: str | None) -> None:
    got = widening(parent, child)
    assert (got[0] if got else None) == reason


@pytest.mark.parametrize(("spec", "expected"), [
    ("svc.call=direct", ("svc.call", "direct")),
    ("svc.call=direct,calls=20", ("svc.call", Grant("direct", calls=20))),
    ("svc.call=approval,per_minute=5,calls=3", ("svc.call", Grant("approval", calls=3, per_minute=5))),
])
def test_cap_spec(spec: str, expected: tuple) -> None:
    assert parse_cap_spec(spec) == expected


@pytest.mark.parametrize("spec", ["svc.call", "svc.call=direkt", "svc.call=direct,calls=-1", "svc.call=direct,calls=x",
                                  "svc.call=direct,per_minute=0", "svc.call=direct,calls=1,calls=2",
                                  "svc.call=direct,burst=3", "svc.call=absent,calls=3"])
def test_cap_spec_refused(spec: str) -> None:
    with pytest.raises(GrantError):
        grant = parse_cap_spec(spec)[1]
        if isinstance(grant, Grant) and grant.tier == "absent":
            from tether.capability.budget import normalize

            normalize({"x": grant})


def test_grant_reading_is_strict() -> None:
    assert read_grant({"tier": "direct", "calls": 0}) == Grant("direct", calls=0)
    for bad in ({"tier": "direct", "calls": True}, {"tier": "direct", "calls": 1.5}, {"calls": 3},
                {"tier": "direct", "extra": 1}, ["direct"], None):
        with pytest.raises(GrantError):
            read_grant(bad)


def test_roles_may_carry_budgets() -> None:
    assert CATALOG.role("worker") == {"svc.call": {"tier": "direct", "calls": 100, "per_minute": 10}}
    with pytest.raises(CatalogError):
        parse_catalog(CATALOG_BAD_ROLE)


CATALOG_BAD_ROLE = """
capabilities:
  svc.call: {http: {host: svc.example, methods: [GET], path: "/*"}}
roles:
  worker: {svc.call: {tier: direct, calls: lots}}
"""


def test_slice_keys_name_every_budgeted_link_and_the_window() -> None:
    chain = [("j-root", {"svc.call": {"tier": "direct", "calls": 20}}), ("j-mid", {"svc.call": "direct"}),
             ("j-leaf", {"svc.call": {"tier": "direct", "calls": 5, "per_minute": 2}})]
    got = [(k.key, k.limit, k.kind) for k in slice_keys(chain, "svc.call", now=125.0, window_s=60)]
    assert got == [("j-root/svc.call", 20, "calls"), ("j-leaf/svc.call", 5, "calls"),
                   ("j-leaf/svc.call/w2", 2, "per_minute")]
    assert slice_keys(chain, "other", now=1.0) == []


@pytest.mark.parametrize(("want", "left", "size"), [
    (1, [100], 1), (50, [100], 25), (50, [100, 8], 2), (50, [3], 1), (5, [0, 100], 0), (5, [-1], 0),
    (10**6, [10**9], 1024),
])
def test_slice_size_table(want: int, left: list[int], size: int) -> None:
    assert slice_size(want, left) == size


def test_next_want_grows_with_use_and_shrinks_when_idle() -> None:
    assert next_want(1, 0.1, 1.0) == 2
    assert next_want(512, 0.1, 1.0) == 1024 == next_want(1024, 0.1, 1.0)
    assert next_want(8, 2.0, 1.0) == 8
    assert next_want(8, 10.0, 1.0) == 4


# -- by hypothesis -----------------------------------------------------------------------------------------
budget = st.one_of(st.none(), st.integers(0, 50))
rate = st.one_of(st.none(), st.integers(1, 50))
grants = st.builds(Grant, st.sampled_from(["direct", "approval"]), budget, rate)


@given(grants, grants)
def test_widening_agrees_with_the_definition(parent: Grant, child: Grant) -> None:
    narrower = (not (parent.tier == "approval" and child.tier == "direct")
                and all(getattr(parent, f) is None or (getattr(child, f) is not None
                                                      and getattr(child, f) <= getattr(parent, f))
                        for f in ("calls", "per_minute")))
    assert (widening(parent, child) is None) == narrower


@given(st.integers(1, 5000), st.lists(st.integers(-5, 10**6), min_size=1, max_size=4), st.floats(0.01, 1.0))
def test_a_slice_never_takes_more_than_is_left(want: int, left: list[int], fraction: float) -> None:
    size = slice_size(want, left, fraction)
    assert 0 <= size <= max(0, min(left))
    assert size <= want
    assert (size == 0) == (min(left) <= 0)


ROOT_KEY, MID_KEY, LEAF_KEY = keys.generate(), keys.generate(), keys.generate()


@settings(max_examples=60, deadline=None)
@given(grants, grants)
def test_minting_and_verifying_agree_on_narrowing(parent: Grant, child: Grant) -> None:
    now = time.time()
    root = mint_root(ROOT_KEY, agent="root", subject_key=MID_KEY.public_key(), caps={"svc.call": parent}, now=now,
                     ttl_s=60, depth=2, catalog=CATALOG)
    link = parse_chain_unverified(root)[0]
    wide = widening(parent, child)
    if wide is not None:
        with pytest.raises(ChainInvalid) as err:
            mint_child(link, MID_KEY, agent="leaf", subject_key=LEAF_KEY.public_key(), caps={"svc.call": child},
                       now=now, ttl_s=60)
        assert err.value.reason == wide[0]
        return
    wire = root + "," + mint_child(link, MID_KEY, agent="leaf", subject_key=LEAF_KEY.public_key(),
                                   caps={"svc.call": child}, now=now, ttl_s=60)
    verified = Verifier(ROOT_KEY.public_key()).verify(wire, now=now)
    assert verified.leaf.grant("svc.call") == child
    assert verified.tier("svc.call") == child.tier


def test_a_forged_widening_link_is_refused_budget_widened() -> None:
    """A delegate that signs a wider budget itself (bypassing mint_child's check) is refused on verification."""
    import jwt

    now = time.time()
    root = mint_root(ROOT_KEY, agent="root", subject_key=MID_KEY.public_key(),
                     caps={"svc.call": {"tier": "direct", "calls": 20}}, now=now, ttl_s=60, depth=2, catalog=CATALOG)
    link = parse_chain_unverified(root)[0]
    ok = mint_child(link, MID_KEY, agent="leaf", subject_key=LEAF_KEY.public_key(),
                    caps={"svc.call": {"tier": "direct", "calls": 5}}, now=now, ttl_s=60)
    claims = dict(parse_chain_unverified(ok)[0].claims)
    for caps in ({"svc.call": {"tier": "direct", "calls": 21}}, {"svc.call": "direct"}):
        forged = jwt.encode({**claims, "caps": caps}, MID_KEY, algorithm="EdDSA", headers={"typ": "tether-grant+jwt"})
        with pytest.raises(ChainInvalid) as err:
            Verifier(ROOT_KEY.public_key()).verify(f"{root},{forged}", now=now)
        assert err.value.reason == "budget_widened"
