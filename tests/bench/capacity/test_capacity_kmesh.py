"""KMesh's capacity strategies on the tiny model and a synthetic All-Gather trace, against a real
store: transcripts restored bit-identically, lost pieces computed again, faults survived."""

import signal

import pytest

from kmesh.bench.capacity.kmesh import GroupStateRun
from kmesh.bench.capacity.store import RoundStats
from kmesh.recovery.recover import RecoveryConfig
from kmesh.workloads.allgather import group_rounds
from tests.conftest import synthetic_allgather_turns
from tests.store.helpers import corrupt_segment

# The tiny model's random weights deviate at any layer: no gate.
NO_GATE = RecoveryConfig("none", 0.0)
AGENTS, ROUNDS = 4, 4


@pytest.fixture(scope="module")
def rounds():
    return group_rounds(synthetic_allgather_turns(agents=AGENTS, rounds=ROUNDS))


def _run(tiny, rounds, store, layout="mirror", declare=True, chunk=4) -> GroupStateRun:
    executor, fingerprint = tiny
    return GroupStateRun(
        executor, fingerprint, rounds, store.socket, layout, declare, NO_GATE, chunk=chunk
    )


def test_mirrored_transcripts_restore_bit_identically_in_fewer_bytes_than_dense(
    tiny, rounds, store_factory
):
    mirror = _run(tiny, rounds, store_factory(capacity="64M")).run()
    dense = _run(tiny, rounds, store_factory(capacity="64M"), layout="dense").run()
    # Each later round restores every member's trunk, private piece and earlier rounds' pieces.
    expected = sum(AGENTS * (2 + r - 1) for r in range(1, ROUNDS))
    for stats in (mirror, dense):
        assert sum(s.restores_checked for s in stats) == expected
        assert sum(s.pieces_lost + s.restore_mismatches + s.recomputed for s in stats) == 0
    assert [s.round_computed for s in mirror] == [s.round_computed for s in dense]
    assert mirror[-1].transcript_bytes < dense[-1].transcript_bytes / 1.5
    assert mirror[-1].held_bytes < dense[-1].held_bytes / 1.5
    assert mirror[-1].own_bytes < mirror[-1].transcript_bytes  # masters counted once


def test_future_use_retention_loses_less_than_lru_in_a_store_too_small(tiny, rounds, store_factory):
    """The store holds 70% of what the rounds publish: LRU evicts the heads of the chains read
    next; declared future use lets the furthest member's tail go first."""
    held = _run(tiny, rounds, store_factory(capacity="64M")).run()[-1].held_bytes
    capacity = str(held * 7 // 10)
    lru = _run(tiny, rounds, store_factory(capacity=capacity, retention="lru"), declare=False)
    future = _run(tiny, rounds, store_factory(capacity=capacity), declare=True)
    lru_stats, future_stats = lru.run(), future.run()
    lost = [sum(s.pieces_lost for s in stats) for stats in (lru_stats, future_stats)]
    recomputed = [sum(s.recomputed for s in stats) for stats in (lru_stats, future_stats)]
    assert lost[0] > 0 and recomputed[0] > 0  # too small: the test exercises loss
    assert recomputed[1] < recomputed[0] / 2 and lost[1] < lost[0]
    assert all(s.restore_mismatches == 0 for s in (*lru_stats, *future_stats))


def _round_2_after_corrupting(tiny, rounds, store, key_of) -> RoundStats:
    """Round 2 after rounds 0 and 1, with the entry of `key_of(run)` corrupted in between."""
    run = _run(tiny, rounds, store)
    try:
        run.round(0)
        run.round(1)
        with store.client() as client:
            [hit] = client.acquire([key_of(run)]).hits
            corrupt_segment(hit.name, offset=hit.size - 7)
        return run.round(2)
    finally:
        run.close()


def test_a_corrupted_piece_is_dropped_and_computed_again(tiny, rounds, store_factory):
    store = store_factory(capacity="64M")
    stats = _round_2_after_corrupting(tiny, rounds, store, lambda run: run.members[2].keys[1])
    assert stats.pieces_lost == 2  # member 2's private piece and its round-1 piece after it
    assert stats.recomputed > 0 and stats.restore_mismatches == 0
    assert stats.restores_checked == AGENTS * 3 - 2


def test_a_corrupted_master_is_dropped_and_every_mirror_of_it_computed_again(
    tiny, rounds, store_factory
):
    store = store_factory(capacity="64M")
    stats = _round_2_after_corrupting(tiny, rounds, store, lambda run: run.master_keys[0])
    assert stats.pieces_lost == AGENTS  # each member's round-1 piece mirrors the lost master
    assert stats.restores_checked == AGENTS * 2  # trunk and private pieces
    assert stats.recomputed > 0 and stats.restore_mismatches == 0


def test_a_store_killed_between_rounds_leaves_every_transcript_computed(
    tiny, rounds, store_factory
):
    store = store_factory(capacity="64M")
    run = _run(tiny, rounds, store, chunk=2)
    try:
        run.round(0)
        first = run.round(1)
        store.stop(signal.SIGKILL)
        stats = run.round(2)
    finally:
        run.close()
    assert not run.store.available
    assert stats.restores_checked == 0 and stats.pieces_lost == AGENTS * 3
    assert stats.recomputed > first.round_computed  # every transcript, in full
    assert stats.held_bytes == 0
