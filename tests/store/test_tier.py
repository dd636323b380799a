"""The shared-memory tier alone: eviction order, pins, refusals, accounting and segment cleanup."""

import random
from pathlib import Path

import pytest

from kmesh.store.tier import CapacityError, SharedMemoryTier, StoredEntry

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def _ident(i: int, tenant: str | None = None) -> tuple[bytes, str | None]:
    return (i.to_bytes(32, "big"), tenant)


def _put(tier: SharedMemoryTier, i: int, size: int = 100, tenant: str | None = None):
    return tier.commit(_ident(i, tenant), tier.reserve(size), checksum=i, meta=b"")


def test_eviction_takes_the_least_recently_used_unpinned_entry():
    tier = SharedMemoryTier(capacity=300)
    try:
        a, b, c = (_put(tier, i) for i in range(3))
        tier.pin(_ident(0))
        tier.lookup(_ident(1))  # b is now more recent than c
        _put(tier, 3)
        assert tier.lookup(_ident(2)) is None and not (SHM / c.name).exists()
        assert tier.lookup(_ident(0)) == a and tier.lookup(_ident(1)) == b
        assert tier.stats().evicted == 1 and tier.stats().used == 300
    finally:
        tier.close()


def test_refusals_evict_nothing_and_say_why():
    tier = SharedMemoryTier(capacity=300, retention="lru")  # lru: pins are hard
    try:
        _put(tier, 0)
        tier.pin(_ident(0))
        pending = tier.reserve(100)
        _put(tier, 1)
        with pytest.raises(CapacityError, match="only 100 can be evicted") as full:
            tier.reserve(250)
        assert full.value.code == "full"
        with pytest.raises(CapacityError, match="exceeds the store's capacity") as too_large:
            tier.reserve(301)
        assert too_large.value.code == "too_large"
        assert tier.lookup(_ident(1)) is not None and tier.stats().evicted == 0
        tier.cancel(pending)
        assert not (SHM / pending).exists() and tier.stats().used == 200
    finally:
        tier.close()


def test_pins_are_counted_and_a_stale_unpin_is_ignored():
    tier = SharedMemoryTier(capacity=200)
    try:
        first = _put(tier, 0)
        tier.pin(_ident(0))
        tier.pin(_ident(0))
        tier.unpin(_ident(0), first.serial, None)
        assert tier.stats().pinned == 1
        assert tier.drop(_ident(0))  # a corrupt entry goes even when pinned
        second = _put(tier, 0)
        tier.pin(_ident(0))
        tier.unpin(_ident(0), first.serial, None)  # the old entry's pin: not this one's
        assert tier.stats().pinned == 1
        tier.unpin(_ident(0), second.serial, None)
        assert tier.stats().pinned == 0
    finally:
        tier.close()


def test_tenants_are_separate_entries_and_drop_checks_the_segment():
    tier = SharedMemoryTier(capacity=1000)
    try:
        mine = _put(tier, 0, tenant="a")
        assert tier.lookup(_ident(0, "b")) is None and tier.lookup(_ident(0)) is None
        assert not tier.drop(_ident(0, "b"))
        assert not tier.drop(_ident(0, "a"), name="another-segment")
        assert tier.drop(_ident(0, "a"), name=mine.name) and not (SHM / mine.name).exists()
    finally:
        tier.close()


@pytest.mark.parametrize("retention", ["future_use", "lru"])
def test_random_operations_keep_the_accounting_exact(retention):
    rng = random.Random(7)
    capacity = 5000
    tier = SharedMemoryTier(capacity, retention)
    committed: dict[tuple[bytes, str | None], StoredEntry] = {}
    reserved: dict[str, int] = {}
    most_pinned = 0
    pins: dict[tuple[bytes, str | None], int] = {}  # pins on the ident's current entry
    try:
        for _ in range(600):
            ident = _ident(rng.randrange(20), rng.choice([None, "t"]))
            op = rng.choice(["reserve", "commit", "cancel", "pin", "unpin", "drop", "lookup"])
            if op == "reserve":
                size = rng.randrange(1, 1500)
                try:
                    reserved[tier.reserve(size)] = size
                except CapacityError as error:
                    assert error.code == "full"
            elif op == "commit" and reserved:
                name = rng.choice(list(reserved))
                del reserved[name]
                committed[ident] = tier.commit(ident, name, 0, b"")
                pins[ident] = 0
            elif op == "cancel" and reserved:
                name = rng.choice(list(reserved))
                del reserved[name]
                tier.cancel(name)
            elif op == "pin" and tier.pin(ident) is not None:
                pins[ident] += 1
            elif op == "unpin" and pins.get(ident):
                tier.unpin(ident, committed[ident].serial, None)
                pins[ident] -= 1
            elif op == "drop" and tier.drop(ident):
                pins[ident] = 0
            else:
                tier.lookup(ident)
            present = {i: e for i, e in committed.items() if tier.lookup(i) == e}
            for i in committed:
                if i not in present:
                    pins[i] = 0  # evicted (soft pins) or replaced: its pins went with it
            if retention == "lru":  # hard pins: never evicted
                assert all(i in present for i, count in pins.items() if count)
            stats = tier.stats()
            expected = sum(e.size for e in present.values()) + sum(reserved.values())
            assert stats.used == expected <= capacity
            assert stats.entries == len(present)
            most_pinned = max(most_pinned, stats.pinned)
            for i, entry in committed.items():
                assert (SHM / entry.name).exists() == (i in present)
        assert tier.stats().evicted > 10 and most_pinned > 1  # the test did exercise both
    finally:
        tier.close()
    for entry in committed.values():
        assert not (SHM / entry.name).exists()
    for name in reserved:
        assert not (SHM / name).exists()


def test_a_reservation_takes_a_warm_spare_of_its_size_and_only_once_warmed():
    tier = SharedMemoryTier(capacity=1000)
    try:
        spares = tier.make_spares(100, 3)
        assert len(spares) == 3 and tier.stats().spares == 3 and tier.stats().used == 0
        assert tier.reserve(100) not in spares  # not warmed yet: never handed out
        assert tier.warmed([spares[0], "kmesh-not-a-spare"]) == 1
        assert tier.reserve(100) == spares[0]
        assert tier.reserve(60) not in spares  # another size: a fresh segment
        assert tier.stats().spares == 2 and tier.stats().used == 260
    finally:
        tier.close()
    assert not any((SHM / name).exists() for name in spares)


def test_spares_fill_only_free_room_and_go_before_any_entry_is_evicted():
    tier = SharedMemoryTier(capacity=1000)
    try:
        _put(tier, 0, size=300)
        spares = tier.make_spares(200, 10)
        assert len(spares) == 3  # 700 bytes free
        tier.warmed(spares[:2])
        _put(tier, 1, size=250)  # 300 + 250 + 3 x 200 > 1000: a warm spare goes, no entry
        assert tier.stats().evicted == 0 and tier.stats().spares == 2
        assert [(SHM / name).exists() for name in spares].count(False) == 1
        assert tier.lookup(_ident(0)) is not None and tier.lookup(_ident(1)) is not None
        assert tier.make_spares(200, 10) == []  # 300 + 250 + 2 x 200 held: no room for 200
        _put(tier, 2, size=500)  # both spares go, then the oldest entry (550 + 500 > 1000)
        assert tier.stats().spares == 0 and tier.stats().evicted == 1
        assert tier.lookup(_ident(0)) is None
    finally:
        tier.close()
