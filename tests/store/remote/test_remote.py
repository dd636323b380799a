"""Two "machines" (store processes with their own shared memory tiers) in front of one remote tier
(a real mooncake_master on loopback ports): restore, single flight, faults, tenants, group state."""

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kmesh.state.keys import KeyNamespace, block_key, piece_key
from kmesh.state.recovery_meta import RecoverySpec, RoundSpec
from kmesh.store.process import MasterProcess
from kmesh.store.protocol import checksum
from kmesh.store.remote.mooncake_tier import MooncakeTier
from kmesh.store.shared.group_state import (
    fetch,
    fetch_master,
    master_payload,
    piece_payload,
    publish,
    read_piece,
    restore_piece,
)
from tests.conftest import StoreProcess
from tests.engine.test_recovery import ASK, ROUND, sibling
from tests.store.helpers import (
    SPAWN,
    chain,
    collect,
    digest,
    fetch_or_compute,
    payload_for,
    read_digest,
    stalled_leader,
    wait_until,
)
from tests.store.shared.test_group_state import CONFIG, NAMESPACE, _master, _member_piece

Machines = Callable[..., list[StoreProcess]]


@pytest.fixture
def master(short_dir: Path) -> Iterator[MasterProcess]:
    """A master per test: one shared by several would carry their faults (a killed lender's
    memory stays mounted for --client_ttl; a restart) into the next."""
    master = MasterProcess(short_dir)
    master.start()
    yield master
    master.stop()


@pytest.fixture
def machines(master: MasterProcess, store_factory) -> Machines:
    """`count` stores, each with its own tier, all in front of the one remote tier."""

    def make(count: int = 2, **options) -> list[StoreProcess]:
        return [store_factory(remote=master, **options) for _ in range(count)]

    return make


def _published(client, keys: list[bytes]) -> None:
    got = client.acquire(keys)
    assert list(got.lead) == keys, got
    for key in keys:
        client.publish(key, payload_for(key))
    _written_through(client)


def _written_through(client) -> None:
    """Until the store has written every published entry through (a reader on another machine
    that comes earlier misses it and computes)."""
    wait_until(lambda: client.stats()["remote_pending"] == 0, timeout=30, what="write-through")


def test_an_entry_published_on_one_machine_is_read_on_the_other_bit_for_bit(machines):
    a, b = machines()
    keys = chain(3, seed=11)
    with a.client() as on_a, b.client() as on_b:
        _published(on_a, keys)
        got = on_b.acquire(keys)  # looked up remotely: the asker waits for the fetch
        assert len(got.hits) == 3 and not got.lead
        assert [read_digest(on_b, hit) for hit in got.hits] == [
            digest(payload_for(k)) for k in keys
        ]
        stats = on_b.stats()
    assert stats["remote_fetched"] == 3 and stats["published"] == 0 and stats["misses"] == 0


def test_eight_processes_on_two_machines_compute_a_missing_chain_once(machines):
    stores = machines()
    keys = chain(4, seed=12)
    start = SPAWN.Barrier(8)
    results = SPAWN.Queue()
    processes = [
        SPAWN.Process(
            target=fetch_or_compute, args=(stores[i % 2].socket, keys, 0.5, start, results)
        )
        for i in range(8)
    ]
    for process in processes:
        process.start()
    outcomes = collect(results, processes, timeout=120)
    assert all(led >= 0 for _, led, _ in outcomes), outcomes
    assert sum(led for _, led, _ in outcomes) == 4  # each key computed by one process
    expected = [digest(payload_for(key)) for key in keys]
    assert all(digests == expected for _, _, digests in outcomes)
    stats = []
    for store in stores:
        with store.client() as client:
            stats.append(client.stats())
    assert sum(s["published"] for s in stats) == 4
    assert sum(s["remote_fetched"] for s in stats) == 4  # the other machine fetched each once


def test_a_waiter_on_another_machine_computes_once_the_leading_machine_dies(machines):
    a, b = machines(remote_lease=1.0)
    keys = chain(2, seed=13)
    leading = SPAWN.Event()
    leader = SPAWN.Process(target=stalled_leader, args=(a.socket, keys, leading))
    leader.start()
    try:
        assert leading.wait(30)
        with b.client() as on_b:
            got = on_b.acquire(keys)
            assert got.waiting_on == keys[0] and not got.lead  # machine A computes it
            a.stop(signal.SIGKILL)  # the whole machine: its claims are beaten no more
            got = on_b.wait(keys, timeout=30)
            assert list(got.lead) == keys
            assert on_b.stats()["remote_claimed"] == 2
    finally:
        leader.kill()
        leader.join(5)


def test_a_remote_claim_nobody_beats_runs_out_and_a_waiter_on_another_machine_takes_over(
    machines, master
):
    [b] = machines(1, remote_lease=1.0)
    keys = chain(2, seed=19)
    silent = MooncakeTier(master.address, master.metadata, "127.0.0.1", 0)
    try:  # a holder that took the claims and then hung: alive to Mooncake, silent to kmesh
        assert silent.take_claims([((k, None), 0) for k in keys], "hung:1") == [True, True]
        with b.client() as on_b:
            started = time.monotonic()
            got = on_b.acquire(keys)
            assert got.waiting_on == keys[0]
            got = on_b.wait(keys, timeout=30)
            assert list(got.lead) == keys
            assert time.monotonic() - started >= 1.0  # not before its lease ran out
    finally:
        silent.close()


def test_a_leader_that_gives_up_hands_its_keys_to_the_other_machine_at_once(machines):
    a, b = machines(remote_lease=30.0)
    keys = chain(2, seed=14)
    with a.client() as on_a, b.client() as on_b:
        assert list(on_a.acquire(keys).lead) == keys
        assert on_b.acquire(keys).waiting_on == keys[0]
        on_a.abandon(keys)  # released remotely, not left to a 30 s lease
        got = on_b.wait(keys, timeout=10)
        assert list(got.lead) == keys


def test_after_the_master_restarts_its_state_is_lost_and_keys_are_recomputed(machines, master):
    a, b = machines()
    keys, later = chain(2, seed=15), chain(2, seed=16)
    with a.client() as on_a:
        _published(on_a, keys)
    master.stop()
    master.start()  # same ports, no objects
    with b.client() as on_b:
        deadline = time.monotonic() + 30
        got = on_b.acquire(keys)
        while got.waiting_on is not None and time.monotonic() < deadline:
            got = on_b.wait(keys, timeout=5)
        assert list(got.lead) == keys  # lost: computed again, no error
        for key in keys:
            on_b.publish(key, payload_for(key))
        assert [read_digest(on_b, h) for h in on_b.acquire(keys).hits] == [
            digest(payload_for(k)) for k in keys
        ]
    # the remote tier works again once the stores rejoined it
    wait_until(lambda: _writes_through(a, b, later), timeout=30, what="a write after restart")


def _writes_through(a: StoreProcess, b: StoreProcess, keys: list[bytes]) -> bool:
    with a.client() as on_a, b.client() as on_b:
        got = on_a.acquire(keys)
        for key in got.lead:
            on_a.publish(key, payload_for(key))
        _written_through(on_a)
        return len(on_b.acquire(keys).hits) == len(keys)


def test_a_corrupted_remote_value_is_dropped_and_recomputed(machines, master):
    [b] = machines(1)
    [key] = chain(1, seed=17)
    payload = payload_for(key)
    rogue = MooncakeTier(master.address, master.metadata, "127.0.0.1", 0)
    try:
        wrong = checksum(key, b"", payload) ^ 1  # as if a byte of the payload had flipped
        assert rogue.put((key, None), memoryview(payload), wrong, b"", pin=False)
        assert rogue.present([(key, None)]) == [True]
        with b.client() as on_b:
            got = on_b.acquire([key])
            assert list(got.lead) == [key]  # dropped, and nobody else computes it: b leads
            assert on_b.stats()["remote_fetched"] == 0
        assert rogue.present([(key, None)]) == [False]
    finally:
        rogue.close()


def test_a_full_remote_tier_refuses_writes_and_the_other_machine_computes(machines):
    a, b = machines(capacity="96M", remote_lend="16M")  # 32 MiB remotely, for 64 MiB
    keys = chain(8, seed=18)
    size = 8 << 20
    with a.client() as on_a, b.client() as on_b:
        got = on_a.acquire(keys)
        for key in got.lead:
            on_a.publish(key, payload_for(key, size=size))
        _written_through(on_a)
        assert on_a.stats()["remote_refused"] > 0  # refused, not an error
        got = on_b.acquire(keys)
        while got.waiting_on is not None:
            got = on_b.wait(keys, timeout=10)
        assert len(got.lead) > 0 and len(got.hits) < 8  # some did not fit remotely: computed
        assert all(
            read_digest(on_b, h) == digest(payload_for(k, size=size))
            for h, k in zip(got.hits, keys, strict=False)
        )


def test_tenants_and_adapters_stay_apart_across_machines(machines):
    a, b = machines()
    base = KeyNamespace("f" * 64, tenant_salt=None)
    adapter = KeyNamespace("f" * 64, adapter="lora-1", tenant_salt=None)
    tokens = list(range(3, 19))
    base_key, adapter_key = block_key(base, None, tokens), block_key(adapter, None, tokens)
    assert base_key != adapter_key  # the adapter is in the key: the same tokens never meet
    with a.client(tenant="alice") as alice_a:
        _published(alice_a, [base_key])
    with b.client(tenant="bob") as bob_b, b.client(tenant="alice") as alice_b:
        assert list(bob_b.acquire([base_key]).lead) == [base_key]  # a plain miss for bob
        bob_b.abandon([base_key])
        assert len(alice_b.acquire([base_key]).hits) == 1
        assert list(alice_b.acquire([adapter_key]).lead) == [adapter_key]


def test_a_rounds_master_and_mirrors_written_on_one_machine_restore_bit_identically_on_the_other(
    machines,
):
    a, b = machines()
    master = _master([5, 16, 23])
    piece = _member_piece(master, start=100, private=6)
    master_key = piece_key(NAMESPACE, None, [1, 2, 3])
    piece_key_ = piece_key(NAMESPACE, master_key, [4])
    with a.client(tenant="t") as on_a:
        on_a.acquire([master_key, piece_key_])
        publish(on_a, master_key, master_payload(master))
        publish(on_a, piece_key_, piece_payload(piece), family="council", next_use=1)
        _written_through(on_a)
    with b.client(tenant="t") as on_b:
        fetched = fetch_master(on_b, master_key, CONFIG)
        stored = fetch(on_b, piece_key_, read_piece)
        assert fetched is not None and stored is not None
        k, v = restore_piece(stored[0], fetched[0], CONFIG)
        want_k, want_v = restore_piece(piece, master, CONFIG)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert on_b.stats()["remote_fetched"] == 2


def test_engines_on_two_machines_share_a_rounds_master_and_restore_a_transcript(
    machines, make_tiny_engine
):
    """Engine A (machine A) runs round 1's first sibling, publishing the master; engine B
    (machine B) mirrors that master into the other siblings instead of building one. Then A runs
    agent 1's round 2 (publishing its transcript) and B runs it again: B finds the transcript
    through the remote tier and restores it, with A's greedy tokens."""
    first_round = RecoverySpec(policy="none", gate=None, round=ROUND)
    second_round = RecoverySpec(
        policy="none", gate=None, round=RoundSpec(id="r2", segments=["c", "d"])
    )
    requests = [sibling(i, order, first_round) for i, order in enumerate(("ab", "ba", "ba"))]
    one = make_tiny_engine().generate(requests)
    a, b = machines(capacity="64M")
    on_a, on_b = make_tiny_engine(store=a.socket), make_tiny_engine(store=b.socket)
    try:
        [built] = on_a.generate(requests[:1])
        with a.client() as client:
            _written_through(client)
        mirrored = on_b.generate(requests[1:])
        [written] = on_a.generate([sibling(1, "ba", second_round, then="cd")])
        with a.client() as client:
            _written_through(client)
        [restored] = on_b.generate([sibling(1, "ba", second_round, then="cd")])
    finally:
        on_a.close()
        on_b.close()
    assert [o.output_ids for o in [built, *mirrored]] == [o.output_ids for o in one]
    for out in mirrored:
        assert out.stats.recovery is not None and out.stats.recovery["master_bytes"] == 0
    assert restored.output_ids == written.output_ids
    report = restored.stats.recovery
    assert report is not None and report["restored_tokens"] > 0
    assert report["computed_tokens"] == len(ASK) - 1
