"""A real store process and real client processes: publish, look up, single flight, tenants."""

import errno
import mmap

import numpy as np
import pytest

from kmesh.store.errors import StoreUnavailable
from kmesh.store.protocol import PROTOCOL_VERSION, Acquired, decode_answer
from tests.store.helpers import (
    SPAWN,
    chain,
    collect,
    connect_raw,
    digest,
    fetch_or_compute,
    payload_for,
    read_digest,
    request_raw,
)


def test_a_published_entry_is_read_zero_copy_by_another_process(store):
    [key] = chain(1, seed=1)
    payload = payload_for(key)
    seen_while_writing = []
    with store.client() as writer, store.client() as other:
        assert writer.acquire([key]).lead == (key,)

        def chunks():
            yield payload
            seen_while_writing.append(other.acquire([key]))  # written, not committed

        writer.publish_into(key, len(payload), chunks(), meta={"dtype": "uint8", "shape": [65536]})
        [during] = seen_while_writing
        assert during.hits == () and during.lead == () and during.waiting_on == key

        results = SPAWN.Queue()
        reader = SPAWN.Process(
            target=fetch_or_compute, args=(store.socket, [key], 0.0, None, results)
        )
        reader.start()
        [(_, led, digests)] = collect(results, [reader], timeout=60)
        assert led == 0 and digests == [digest(payload)]

        [hit] = other.acquire([key]).hits
        with other.read(hit) as entry:
            assert isinstance(entry.data.obj, mmap.mmap)  # a view of the segment, not a copy
            assert entry.data.readonly and bytes(entry.data) == payload
            assert entry.meta == {"dtype": "uint8", "shape": [65536]}


def test_eight_processes_asking_for_the_same_missing_chain_compute_it_once(store):
    keys = chain(4, seed=2)
    start = SPAWN.Barrier(8)
    results = SPAWN.Queue()
    processes = [
        SPAWN.Process(target=fetch_or_compute, args=(store.socket, keys, 0.5, start, results))
        for _ in range(8)
    ]
    for process in processes:
        process.start()
    outcomes = collect(results, processes, timeout=90)
    assert all(led >= 0 for _, led, _ in outcomes), outcomes
    assert sorted(led for _, led, _ in outcomes) == [0] * 7 + [4]
    expected = [digest(payload_for(key)) for key in keys]
    assert all(digests == expected for _, _, digests in outcomes)
    with store.client() as client:
        stats = client.stats()
    assert stats["published"] == 4 and stats["misses"] == 4 and stats["promoted"] == 0


def test_another_tenant_gets_exactly_a_plain_miss_and_keeps_its_own_entry(store):
    published, claimed, never = chain(1, seed=3), chain(1, seed=4), chain(1, seed=5)
    with store.client(tenant="a") as a:
        a.acquire(published)
        a.publish(published[0], payload_for(published[0]))
        assert a.acquire(claimed).lead == tuple(claimed)  # a computes it, has not published

        answers = {}
        for name, keys in (("published", published), ("claimed", claimed), ("never", never)):
            sock = connect_raw(store.socket)
            request = {"v": PROTOCOL_VERSION, "op": "acquire", "tenant": "b", "keys": keys}
            answers[name] = request_raw(sock, request)
            sock.close()  # b's claims end with its connection
        assert answers["published"] == answers["claimed"] == answers["never"]
        answer = decode_answer(answers["never"])
        assert isinstance(answer, Acquired) and answer.hits == [] and answer.lead == 1

        with store.client(tenant="b") as b:
            assert b.acquire(published).lead == tuple(published)
            b.publish(published[0], payload_for(published[0], salt=b"b"))
            [b_hit] = b.acquire(published).hits
            assert read_digest(b, b_hit) == digest(payload_for(published[0], salt=b"b"))
            assert b.drop(b_hit)  # only b's entry goes

        with store.client(tenant="a") as a2:
            [a_hit] = a2.acquire(published).hits
            assert read_digest(a2, a_hit) == digest(payload_for(published[0]))
        with store.client(tenant=None) as shared:
            assert shared.acquire(published).lead == tuple(published)


def test_an_array_round_trips_with_its_dtype_and_shape(store):
    [key] = chain(1, seed=6)
    kv = np.random.default_rng(0).standard_normal((2, 4, 16, 3, 64), dtype=np.float32)
    with store.client() as client:
        client.acquire([key])
        client.publish(key, kv, meta={"dtype": str(kv.dtype), "shape": list(kv.shape)})
        [hit] = client.acquire([key]).hits
        entry = client.read(hit)
        view = np.frombuffer(entry.data, entry.meta["dtype"]).reshape(entry.meta["shape"])
        restored = view.copy()  # what the engine does: copy into its own KV
        with pytest.raises(BufferError, match="still alive"):
            entry.close()
        del view
        entry.close()
    assert np.array_equal(restored, kv)


def test_a_writer_that_fails_abandons_the_key(store):
    [key] = chain(1, seed=7)
    with store.client() as leader, store.client() as other:
        leader.acquire([key])

        def fail():
            yield bytes(512)
            raise RuntimeError("out of memory while copying")

        with pytest.raises(RuntimeError, match="copying"):
            leader.publish_into(key, 1024, fail())
        assert other.acquire([key]).lead == (key,)
        assert other.stats()["reserved"] == 0 and other.stats()["entries"] == 0


@pytest.mark.parametrize("chunks", [[bytes(1000)], [bytes(1000), bytes(25)]], ids=["short", "long"])
def test_chunks_that_do_not_fill_the_reservation_exactly_publish_nothing(store, chunks):
    [key] = chain(1, seed=8)
    with store.client() as leader, store.client() as other:
        leader.acquire([key])
        with pytest.raises(ValueError, match="1024"):
            leader.publish_into(key, 1024, chunks)
        assert other.acquire([key]).lead == (key,)
        assert other.stats()["reserved"] == 0 and other.stats()["entries"] == 0


def test_a_segment_that_takes_no_write_is_a_store_error_and_the_key_is_abandoned(
    store, monkeypatch
):
    [key] = chain(1, seed=10)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    with store.client() as leader, store.client() as other:
        leader.acquire([key])
        monkeypatch.setattr("kmesh.store.segments.os.pwrite", full)
        with pytest.raises(StoreUnavailable, match="took no write"):
            leader.publish_into(key, 1024, [bytes(1024)])
        monkeypatch.undo()
        assert other.acquire([key]).lead == (key,)
        assert other.stats()["reserved"] == 0


def test_an_entry_written_in_chunks_reads_back_as_their_concatenation(store):
    [key] = chain(1, seed=9)
    parts = [b"head", bytes(range(256)) * 3, b"tail"]
    with store.client() as writer:
        writer.acquire([key])
        writer.publish_into(key, sum(map(len, parts)), parts)
        [hit] = writer.acquire([key]).hits
        with writer.read(hit) as entry:  # its checksum verified: the chunks' chained CRC
            assert bytes(entry.data) == b"".join(parts)


def test_prefaulted_spares_are_made_warm_and_taken_by_a_publish_of_their_size(store):
    [key] = chain(1, seed=11)
    with store.client() as client:
        assert client.prefault(4096, 3) == 3
        assert client.stats()["spares"] == 3 and client.stats()["used"] == 0
        client.acquire([key])
        client.publish_into(key, 4096, [bytes(range(256)) * 16])
        assert client.stats()["spares"] == 2
        [hit] = client.acquire([key]).hits
        with client.read(hit) as entry:  # the spare's zeros were overwritten, checksum and all
            assert bytes(entry.data) == bytes(range(256)) * 16
