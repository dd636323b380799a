"""Warm segments: made ahead by the store's thread, taken by reservations, bounded by the free
capacity, freed when their size goes out of use and when the tier closes."""

import time
from pathlib import Path

import pytest

from kmesh.store.tier import SharedMemoryTier

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
SIZE = 3 << 20  # three of the 1 MiB chunks a segment is touched with


def _warm_settles(tier: SharedMemoryTier, expected: int) -> None:
    """Wait for the filling thread to reach `expected` bytes (it never passes its bound)."""
    deadline = time.monotonic() + 30
    while tier.stats().warm != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.stats().warm == expected


def _segments(reserved: str) -> set[str]:
    """The tier's segments in /dev/shm: those named with the prefix of one it reserved."""
    prefix = reserved[: reserved.rindex("-") + 1]
    return {path.name for path in SHM.glob(prefix + "*")}


def test_a_reservation_after_the_first_takes_a_warm_zero_filled_segment():
    tier = SharedMemoryTier(capacity=10 * SIZE, prewarm=3 * SIZE)
    try:
        first = tier.reserve(SIZE)  # no size asked for yet: made on the spot
        _warm_settles(tier, 3 * SIZE)
        warm = _segments(first) - {first}
        second = tier.reserve(SIZE)
        assert len(warm) == 3 and second in warm
        assert (SHM / second).read_bytes() == bytes(SIZE)
        assert tier.stats().used == 2 * SIZE and tier.stats().reserved == 2
        _warm_settles(tier, 3 * SIZE)  # refilled
    finally:
        tier.close()
    assert not _segments(first)


def test_warm_segments_fill_only_the_free_capacity():
    tier = SharedMemoryTier(capacity=3 * SIZE, prewarm=10 * SIZE)
    try:
        tier.reserve(SIZE)
        _warm_settles(tier, 2 * SIZE)
        tier.reserve(SIZE)  # a warm one, and the thread is woken again: nothing more fits
        time.sleep(0.2)
        assert tier.stats().warm == SIZE and tier.stats().used == 2 * SIZE
    finally:
        tier.close()


def test_a_new_size_frees_the_warm_segments_of_the_old_one():
    tier = SharedMemoryTier(capacity=10 * SIZE, prewarm=2 * SIZE)
    try:
        first = tier.reserve(SIZE)
        _warm_settles(tier, 2 * SIZE)
        old = _segments(first) - {first}
        second = tier.reserve(2 * SIZE)
        assert len(old) == 2 and not old & _segments(first)
        _warm_settles(tier, 2 * SIZE)
        (new,) = _segments(first) - {first, second}
        assert (SHM / new).stat().st_size == 2 * SIZE
    finally:
        tier.close()
    assert not _segments(first)


def test_without_prewarm_no_segment_is_made_ahead():
    tier = SharedMemoryTier(capacity=10 * SIZE)
    try:
        name = tier.reserve(SIZE)
        time.sleep(0.2)
        assert _segments(name) == {name} and tier.stats().warm == 0
    finally:
        tier.close()
