"""Faults: a killed leader, a killed store, corrupted bytes, a full store, a silent leader."""

import contextlib
import os
import signal
import threading
import time

import pytest

from kmesh.store import EntryLost, StoreRefused, StoreUnavailable
from tests.store.helpers import (
    PAYLOAD_BYTES,
    SPAWN,
    chain,
    collect,
    corrupt_segment,
    digest,
    fetch_or_compute,
    payload_for,
    read_digest,
    stalled_leader,
    wait_until,
)


def test_a_waiter_is_promoted_when_the_leader_is_killed_mid_compute(store):
    keys = chain(3, seed=10)
    leading = SPAWN.Event()
    leader = SPAWN.Process(target=stalled_leader, args=(store.socket, keys, leading))
    leader.start()
    results = SPAWN.Queue()
    waiters = [
        SPAWN.Process(target=fetch_or_compute, args=(store.socket, keys, 0.2, None, results))
        for _ in range(3)
    ]
    try:
        assert leading.wait(60)
        for waiter in waiters:
            waiter.start()
        with store.client() as observer:
            wait_until(lambda: observer.stats()["waiters"] == 3, 60, "three waiting clients")
            killed_at = time.monotonic()
            os.kill(leader.pid, signal.SIGKILL)
            outcomes = collect(results, waiters, timeout=60)
            elapsed = time.monotonic() - killed_at
            stats = observer.stats()
    finally:
        leader.kill()
        leader.join(5)
    assert sorted(led for _, led, _ in outcomes) == [0, 0, 3], outcomes
    expected = [digest(payload_for(key)) for key in keys]
    assert all(digests == expected for _, _, digests in outcomes)
    assert elapsed < 10
    assert stats["promoted"] == 1 and stats["published"] == 3 and stats["claims"] == 0


def test_a_silent_leader_loses_its_claim_when_its_lease_runs_out(store_factory):
    store = store_factory(lease=0.5)
    [key] = chain(1, seed=11)
    with store.client() as silent, store.client() as waiter:
        assert silent.acquire([key]).lead == (key,)
        started = time.monotonic()
        got = waiter.wait([key], timeout=10.0)
        assert got.lead == (key,) and time.monotonic() - started < 5
        with pytest.raises(StoreRefused) as refused:
            silent.publish(key, payload_for(key))
        assert refused.value.code == "not_leader"
        waiter.publish(key, payload_for(key))
        assert waiter.stats()["expired"] == 1


def test_a_waiting_client_learns_promptly_that_the_store_died(store):
    keys = chain(1, seed=12)
    leader = store.client()
    assert leader.acquire(keys).lead == tuple(keys)
    waiter = store.client(timeout=5.0)
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(waiter.wait(keys, timeout=60.0))
        except StoreUnavailable as error:
            outcome.append(error)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: leader.stats()["waiters"] == 1, 30, "the waiter")
    killed_at = time.monotonic()
    store.process.kill()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - killed_at < 5
    [error] = outcome
    assert isinstance(error, StoreUnavailable)
    with pytest.raises(StoreUnavailable):
        leader.publish(keys[0], payload_for(keys[0]))
    # The dying process closes its sockets one by one and may be preempted in between (the
    # listener last): only once it is reaped is the socket surely gone.
    store.process.wait(10)
    with pytest.raises(StoreUnavailable):
        store.client()


def test_a_restoring_client_keeps_what_it_mapped_when_the_store_dies(store):
    keys = chain(2, seed=13)
    with store.client() as publisher:
        publisher.acquire(keys)
        for key in keys:
            publisher.publish(key, payload_for(key))
    reader = store.client()
    first, second = reader.acquire(keys).hits
    mapped = reader.read(first)
    store.process.kill()
    store.process.wait(10)
    assert digest(mapped.data) == digest(payload_for(keys[0]))  # the mapping outlives the store
    mapped.close()
    with contextlib.suppress(EntryLost):  # its segment may be gone: never a hang or bad bytes
        assert read_digest(reader, second) == digest(payload_for(keys[1]))
    with pytest.raises(StoreUnavailable):
        reader.acquire(keys)


def test_corrupted_bytes_fail_the_checksum_and_the_entry_is_dropped(store):
    [key] = chain(1, seed=14)
    with store.client() as a, store.client() as b, store.client() as c:
        a.acquire([key])
        a.publish(key, payload_for(key))
        [hit] = b.acquire([key]).hits
        corrupt_segment(hit.name, offset=12345)
        with pytest.raises(EntryLost, match="checksum"):
            b.read(hit)
        got = c.acquire([key])
        assert got.hits == () and got.lead == (key,)  # a plain miss: c recomputes
        c.publish(key, payload_for(key))
        [fresh] = b.acquire([key]).hits
        assert read_digest(b, fresh) == digest(payload_for(key))
        assert c.stats()["dropped"] == 1


def _present(client, key: bytes) -> bool:
    got = client.acquire([key])
    client.abandon(got.lead)
    return bool(got.hits)


def _publish(client, key: bytes, size: int = PAYLOAD_BYTES, family: str | None = None) -> None:
    assert client.acquire([key]).lead == (key,)
    client.publish(key, payload_for(key, size), family=family)


def test_a_full_lru_store_evicts_unpinned_entries_and_refuses_what_cannot_fit(store_factory):
    store = store_factory(capacity="256K", retention="lru")  # four 64 KiB entries
    pinned, unpinned, later = chain(2, seed=15), chain(2, seed=16), chain(2, seed=17)
    big, huge = chain(1, seed=18)[0], chain(1, seed=19)[0]
    with store.client() as owner, store.client() as other:
        for key in pinned:
            _publish(owner, key, family="f")
        for key in unpinned + later:  # the last two evict the first two
            _publish(owner, key)
        present = [_present(other, key) for key in pinned + unpinned + later]
        assert present == [True, True, False, False, True, True]
        assert other.stats()["evicted"] == 2

        other.acquire([big, huge])
        with pytest.raises(StoreRefused, match="only 131072 can be evicted") as full:
            other.publish(big, payload_for(big, 3 * PAYLOAD_BYTES))
        assert full.value.code == "full"
        with pytest.raises(StoreRefused, match="exceeds the store's capacity") as too_large:
            other.publish(huge, payload_for(huge, 5 * PAYLOAD_BYTES))
        assert too_large.value.code == "too_large"
        assert other.stats()["evicted"] == 2 and other.stats()["claims"] == 0

        assert owner.close_family("f") == 2  # back in the LRU order, as the most recent
        _publish(other, big, 3 * PAYLOAD_BYTES)  # evicts later[0], later[1], pinned[0]
        present = [_present(other, key) for key in [*pinned, *later, big]]
        assert present == [False, True, False, False, True]


def test_a_full_future_use_store_evicts_ended_then_undeclared_then_the_furthest_declared(
    store_factory,
):
    store = store_factory(capacity="256K")  # four 64 KiB entries, retention future_use
    soon, late, ended, plain = chain(4, seed=21)
    extra = chain(3, seed=22)
    with store.client() as owner, store.client() as other:
        _publish(owner, ended, family="done")
        _publish(owner, soon, family="round")
        _publish(owner, late, family="round")
        _publish(owner, plain)
        assert owner.pin("round", [soon], next_use=1) == 1
        assert owner.pin("round", [late], next_use=9) == 1
        assert owner.close_family("done") == 1  # nobody declared it will come back
        _publish(other, extra[0])  # the ended entry goes first, though the most recent of three
        assert [_present(other, k) for k in (ended, plain, soon, late)] == [0, 1, 1, 1]
        _publish(other, extra[1], family="next")  # then the undeclared, least recently used
        assert [_present(other, k) for k in (extra[0], plain)] == [False, True]
        _publish(other, extra[2], 2 * PAYLOAD_BYTES)  # pins are soft: the furthest use goes
        assert [_present(other, k) for k in (plain, soon, late, extra[1])] == [0, 1, 0, 1]
        assert other.stats()["evicted"] == 4


def test_a_closed_connection_releases_its_families_pins(store_factory):
    store = store_factory(capacity="128K", retention="lru")  # two 64 KiB entries
    first, second, third = chain(3, seed=20)
    with store.client() as owner:
        _publish(owner, first, family="f")
        with store.client() as other:
            _publish(other, second)
            with pytest.raises(StoreRefused):  # first is pinned, second is the only evictable
                _publish(other, third, 2 * PAYLOAD_BYTES)
    with store.client() as other:
        _publish(other, third, 2 * PAYLOAD_BYTES)
        assert not _present(other, first) and other.stats()["pinned"] == 0
