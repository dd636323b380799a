"""The store in front of a remote tier, as a state machine fed the worker's answers (no sockets, no
Mooncake): the proxy, write-through, released claims; and foreign leases judged by one clock."""

from collections.abc import Iterator

import pytest

from kmesh.store.protocol import Acquired, Found, HitInfo, Lookup
from kmesh.store.remote.front import (
    Probe,
    Probed,
    Release,
    RemoteFront,
    Resolve,
    Resolved,
    WriteThrough,
)
from kmesh.store.remote.leases import ForeignLeases
from kmesh.store.remote.mooncake_tier import RemoteEntry
from kmesh.store.state_machine import Store
from kmesh.store.tier import SharedMemoryTier
from tests.store.helpers import chain
from tests.store.test_state_machine import LEASE, _acquire, _publish, _stats

GRACE = 3.0


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store(SharedMemoryTier(capacity=4096), LEASE, remote=RemoteFront(grace=GRACE))
    yield store
    store.tier.close()


def _commands(store: Store) -> list:
    assert store.remote is not None
    return store.remote.take_commands()


def test_a_local_miss_waits_on_the_proxy_and_a_fetched_entry_answers_it_as_a_hit(store):
    keys = chain(2, seed=1)
    asker = store.open()
    assert _acquire(store, asker, keys) == []  # parked although it asked not to wait
    assert _commands(store) == [Resolve(((keys[0], None), (keys[1], None)))]
    fetched = tuple(((k, None), RemoteEntry(b"x" * 10, 7, b"m")) for k in keys)
    [(session, answer)] = store.remote_done(Resolved(fetched=fetched), now=0.1)
    assert session is asker and isinstance(answer, Acquired) and answer.lead == 0
    assert [(h.size, h.checksum, h.meta) for h in answer.hits] == [(10, 7, b"m")] * 2
    assert _commands(store) == []  # fetched entries are not written back
    assert _stats(store).remote_fetched == 2 and _stats(store).published == 0


def test_keys_whose_remote_claims_this_machine_took_are_led_by_the_asker(store):
    keys = chain(2, seed=2)
    asker = store.open()
    _acquire(store, asker, keys)
    _commands(store)
    claimed = (((keys[0], None), 0), ((keys[1], None), 3))
    [(session, answer)] = store.remote_done(Resolved(claimed=claimed), now=0.1)
    assert session is asker and answer == Acquired(lead=2, lease=LEASE)
    _publish(store, asker, keys[0], now=0.2)
    [write] = _commands(store)
    assert isinstance(write, WriteThrough)
    assert (write.ident, write.claim, write.size, write.pin) == ((keys[0], None), 0, 100, False)


def test_a_key_another_machine_computes_answers_a_non_waiting_asker_and_keeps_a_waiting_one(store):
    [key] = chain(1, seed=3)
    hasty, patient = store.open(), store.open()
    _acquire(store, hasty, [key])
    _acquire(store, patient, [key], wait=30.0)
    out = store.remote_done(Resolved(busy=((key, None),)), now=0.1)
    assert out == [(hasty, Acquired(wait=True, lease=LEASE))]
    assert patient.waiting is not None
    entry = RemoteEntry(b"y", 1, b"")
    [(session, answer)] = store.remote_done(Resolved(fetched=(((key, None), entry),)), now=2.0)
    assert session is patient and answer == Acquired(
        hits=[HitInfo(answer.hits[0].name, 1, 1, b"")], lease=LEASE
    )


def test_a_failed_lookup_hands_the_key_to_the_asker(store):
    [key] = chain(1, seed=4)
    asker = store.open()
    _acquire(store, asker, [key])
    [(_, answer)] = store.remote_done(Resolved(failed=((key, None),)), now=0.1)
    assert answer == Acquired(lead=1, lease=LEASE)
    assert _stats(store).remote_failed == 1


def test_a_remote_claim_is_released_when_its_local_leader_gives_up_or_none_comes(store):
    given_up, never_led = chain(1, seed=5)[0], chain(1, seed=6)[0]
    leader = store.open()
    _acquire(store, leader, [given_up])
    store.remote_done(Resolved(claimed=(((given_up, None), 2),)), now=0.1)
    store.remote_done(Resolved(claimed=(((never_led, None), 0),)), now=0.1)  # asker gone
    store.expire(now=0.2)
    assert _commands(store) == [Resolve(((given_up, None),))]  # both still held
    store.close(leader, now=0.3)
    store.expire(now=0.4)
    assert _commands(store) == [Release((given_up, None), 2)]
    store.expire(now=0.1 + GRACE + 0.1)
    assert _commands(store) == [Release((never_led, None), 0)]


def test_a_chain_given_up_is_released_tail_first_so_a_waiter_on_its_head_leads_it_whole(store):
    keys = chain(3, seed=7)
    leader = store.open()
    _acquire(store, leader, keys)
    claimed = tuple(((k, None), g) for g, k in enumerate(keys))
    store.remote_done(Resolved(claimed=claimed), now=0.1)
    store.expire(now=0.15)  # the leader leads all three
    _commands(store)
    store.close(leader, now=0.2)
    store.expire(now=0.3)
    assert _commands(store) == [Release((k, None), g) for g, k in reversed(list(enumerate(keys)))]


def test_a_foreign_claim_is_dead_once_its_beat_stands_still_for_the_lease_by_our_clock():
    leases = ForeignLeases(lease=5.0)
    ident = (b"k" * 32, None)
    assert not leases.expired(ident, 0, 0, now=100.0)  # first seen: its clock starts now
    assert not leases.expired(ident, 0, 0, now=104.9)
    assert not leases.expired(ident, 0, 1, now=104.95)  # it beat: alive, the clock restarts
    assert not leases.expired(ident, 0, 1, now=109.9)
    assert leases.expired(ident, 0, 1, now=109.95)
    assert not leases.expired(ident, 1, 0, now=110.0)  # a new generation: a new holder


def test_a_lookup_adds_the_keys_the_remote_tier_holds_or_answers_the_local_ones_in_time(store):
    keys = chain(3, seed=7)
    writer, prober = store.open(), store.open()
    _acquire(store, writer, [keys[2]])
    store.remote_done(Resolved(claimed=(((keys[2], None), 0),)), now=0.0)
    _publish(store, writer, keys[2])
    _commands(store)
    assert store.handle(prober, Lookup(keys, tenant=None), 1.0) == []
    assert store.busy(prober)  # its next request waits for this answer
    [probe] = _commands(store)
    assert isinstance(probe, Probe) and probe.idents == ((keys[0], None), (keys[1], None))
    out = store.remote_done(Probed(probe.probe, (False, True)), now=1.1)
    assert out == [(prober, Found(present=[1, 2]))] and not store.busy(prober)
    assert _stats(store).claims == 0  # a lookup claims nothing
    assert store.handle(prober, Lookup(keys, tenant=None), 2.0) == []
    assert store.expire(now=2.0 + store.remote_wait) == [(prober, Found(present=[2]))]


def test_an_acquire_in_front_of_the_remote_tier_looks_each_key_up_once_per_evaluation():
    tier = SharedMemoryTier(capacity=4096)
    looked_up: list[object] = []
    lookup = tier.lookup

    def counted(ident):
        looked_up.append(ident)
        return lookup(ident)

    tier.lookup = counted  # type: ignore[method-assign]
    store = Store(tier, LEASE, remote=RemoteFront(grace=GRACE))
    try:
        keys = chain(3, seed=9)
        _acquire(store, store.open(), keys)
        # Once by the remote resolve (the proxy claims what it found missing), once by the
        # asker's own evaluation, which stops at the first key, the proxy's.
        assert looked_up == [(keys[0], None), (keys[1], None), (keys[2], None), (keys[0], None)]
    finally:
        tier.close()
