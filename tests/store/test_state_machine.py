"""The store's state machine in-process (no sockets): claims, waiters, promotion, leases."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kmesh.state.tenants import load_api_keys
from kmesh.store.protocol import (
    Abandon,
    Acquire,
    Acquired,
    Commit,
    Done,
    Error,
    Found,
    Hello,
    Lookup,
    Refused,
    Reserve,
    Reserved,
    Stats,
    StatsInfo,
)
from kmesh.store.state_machine import Outbox, Store, StoreSession
from kmesh.store.tier import SharedMemoryTier
from tests.store.helpers import chain

LEASE = 10.0


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store(SharedMemoryTier(capacity=4096), lease=LEASE)
    yield store
    store.tier.close()


def _acquire(store: Store, session: StoreSession, keys: list[bytes], wait: float = 0.0, now=0.0):
    return store.handle(session, Acquire(keys, wait=wait, tenant=None), now)


def _publish(store: Store, session: StoreSession, key: bytes, now: float = 0.0) -> Outbox:
    [(_, reserved)] = store.handle(session, Reserve(key, 100, tenant=None), now)
    assert isinstance(reserved, Reserved)
    return store.handle(session, Commit(key, checksum=0, tenant=None), now)


def _stats(store: Store) -> StatsInfo:
    [(_, stats)] = store.handle(store.open(), Stats(tenant=None), 0.0)
    assert isinstance(stats, StatsInfo)
    return stats


def test_a_promoted_waiter_leads_the_whole_chain_and_the_next_waits_on_it(store):
    keys = chain(3, seed=1)
    leader, first, second = store.open(), store.open(), store.open()
    [(_, led)] = _acquire(store, leader, keys)
    assert led == Acquired(lead=3, lease=LEASE)
    assert _acquire(store, first, keys, wait=5.0) == []  # parked
    assert _acquire(store, second, keys, wait=5.0) == []
    out = store.close(leader, now=1.0)
    assert out == [(first, Acquired(lead=3, lease=LEASE))]
    assert second.waiting is not None and second.waiting.blocked_on == (keys[0], None)
    assert _stats(store).promoted == 1 and _stats(store).claims == 3


def test_a_waiter_follows_the_leader_down_the_chain(store):
    keys = chain(2, seed=2)
    leader, waiter = store.open(), store.open()
    _acquire(store, leader, keys)
    _acquire(store, waiter, keys, wait=5.0)
    out = _publish(store, leader, keys[0])
    assert out == [(leader, Done(count=1))]  # the waiter now waits on keys[1]
    assert waiter.waiting is not None and waiter.waiting.blocked_on == (keys[1], None)
    out = _publish(store, leader, keys[1])
    [answer] = [answer for session, answer in out if session is waiter]
    assert isinstance(answer, Acquired) and len(answer.hits) == 2 and answer.lead == 0


def test_a_lookup_names_the_published_keys_each_on_its_own_and_claims_none(store):
    keys = chain(3, seed=5)
    writer, prober, other = store.open(), store.open(), store.open()
    _acquire(store, writer, [keys[1]])
    _publish(store, writer, keys[1])
    [(_, found)] = store.handle(prober, Lookup(keys, tenant=None), 0.0)
    assert found == Found(present=[1])  # keys[0] missing does not hide keys[1]
    [(_, found)] = store.handle(prober, Lookup(keys, tenant="another"), 0.0)
    assert found == Found(present=[])  # another tenant's namespace
    # Nothing claimed: another client leads the missing keys at once, no wait.
    [(_, led)] = _acquire(store, other, [keys[0]])
    assert led == Acquired(lead=1, lease=LEASE)
    assert _stats(store).claims == 1


def test_a_wait_that_runs_out_answers_wait_and_a_lease_that_runs_out_promotes(store):
    [key] = chain(1, seed=3)
    leader, waiter = store.open(), store.open()
    _acquire(store, leader, [key], now=0.0)
    _acquire(store, waiter, [key], wait=2.0, now=0.0)
    assert store.next_deadline() == 2.0
    assert store.expire(now=1.9) == []
    assert store.expire(now=2.0) == [(waiter, Acquired(wait=True, lease=LEASE))]
    _acquire(store, waiter, [key], wait=60.0, now=3.0)
    assert store.next_deadline() == LEASE  # the leader's lease, renewed at 0.0
    assert store.expire(now=LEASE) == [(waiter, Acquired(lead=1, lease=LEASE))]
    [(_, refused)] = store.handle(leader, Reserve(key, 10, tenant=None), LEASE + 1)
    assert isinstance(refused, Refused) and refused.code == "not_leader"
    assert _stats(store).expired == 1


def test_claims_stop_at_another_leaders_key_and_abandon_wakes_its_waiters(store):
    keys = chain(3, seed=4)
    a, b, c = store.open(), store.open(), store.open()
    _acquire(store, a, keys[1:2])
    [(_, led)] = _acquire(store, b, keys)
    assert led == Acquired(lead=1, lease=LEASE)  # keys[0] only: keys[1] is a's
    _acquire(store, c, keys, wait=5.0)
    out = store.handle(b, Abandon([keys[0], keys[0], keys[2]], tenant=None), 1.0)
    assert (b, Done(count=1)) in out and (c, Acquired(lead=1, lease=LEASE)) in out


def test_a_refused_reserve_releases_the_claim_to_a_waiter(store):
    [key] = chain(1, seed=5)
    leader, waiter = store.open(), store.open()
    _acquire(store, leader, [key])
    _acquire(store, waiter, [key], wait=5.0)
    out = store.handle(leader, Reserve(key, 5000, tenant=None), 1.0)
    assert (waiter, Acquired(lead=1, lease=LEASE)) in out
    [refused] = [answer for session, answer in out if session is leader]
    assert isinstance(refused, Refused) and refused.code == "too_large"
    assert "claim was released" in refused.reason


def _keyed_store(unkeyed: Store, folder: Path) -> Store:
    """A store on the same tier whose API keys are key-of-a (tenant a) and key-of-b (b)."""
    (folder / "keys.json").write_text(json.dumps({"key-of-a": "a", "key-of-b": "b"}))
    return Store(unkeyed.tier, lease=LEASE, api_keys=load_api_keys(folder / "keys.json"))


def test_with_api_keys_a_connection_must_say_hello_with_a_known_key(store, tmp_path):
    keyed = _keyed_store(store, tmp_path)
    session = keyed.open()
    [(_, refused)] = _acquire(keyed, session, chain(1, seed=3))
    assert isinstance(refused, Error) and refused.code == "unauthorized"
    [(_, refused)] = keyed.handle(session, Hello(key="key-of-nobody", tenant=None), 0.0)
    assert isinstance(refused, Error) and refused.code == "unauthorized"
    [(_, done)] = keyed.handle(session, Hello(key="key-of-a", tenant=None), 0.0)
    assert done == Done()
    [(_, led)] = _acquire(keyed, session, chain(1, seed=3))
    assert led == Acquired(lead=1, lease=LEASE)


def test_a_keys_tenant_never_sees_another_keys_entries_whatever_tenant_it_names(store, tmp_path):
    keyed = _keyed_store(store, tmp_path)
    [key] = chain(1, seed=4)
    a, b, a_again = keyed.open(), keyed.open(), keyed.open()
    for session, api_key in ((a, "key-of-a"), (b, "key-of-b"), (a_again, "key-of-a")):
        keyed.handle(session, Hello(key=api_key, tenant=None), 0.0)
    _acquire(keyed, a, [key])
    _publish(keyed, a, key)
    for named in (None, "x#tenant=a", "#tenant=a"):
        [(_, got)] = keyed.handle(b, Acquire([key], tenant=named), 0.0)
        assert isinstance(got, Acquired) and got.hits == [], named
    [(_, got)] = _acquire(keyed, a_again, [key])
    assert isinstance(got, Acquired) and len(got.hits) == 1
