"""Holdings: what a store client holds on its connection, without a store."""

from kmesh.store.holdings import Holdings


def test_a_fresh_client_holds_nothing():
    assert not Holdings().any(now=0.0)


def test_a_led_claim_holds_until_its_lease_runs_out():
    holdings = Holdings()
    holdings.leading([b"k" * 32], lease=5.0)
    assert holdings.any(now=holdings.lease_end - 1.0)
    assert not holdings.any(now=holdings.lease_end + 1.0)


def test_a_claim_let_go_holds_nothing():
    holdings = Holdings()
    holdings.leading([b"a" * 32, b"b" * 32], lease=60.0)
    holdings.let_go([b"a" * 32])
    assert holdings.any()
    holdings.let_go([b"b" * 32])
    assert not holdings.any()


def test_a_pinned_family_holds_whatever_the_lease():
    holdings = Holdings()
    holdings.families.add("council")
    assert holdings.any(now=1e12)
    holdings.clear()
    assert not holdings.any(now=0.0)
