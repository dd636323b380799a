"""The reference engine with a store: restore on a local miss, publish after computing, fall back
to computing on every store failure. Tiny model, real store process."""

import signal
from pathlib import Path

from kmesh.engine.request import Request, SamplingParams
from kmesh.engine.sequence import Sequence
from kmesh.state.keys import KeyNamespace, block_key
from kmesh.store.tier import SHM_DIR
from tests.conftest import random_tokens

PROMPT = tuple(random_tokens(100, seed=11))  # 6 full blocks of 16 before the last token
PARAMS = SamplingParams(max_tokens=8)


def _run(engine, prompt=PROMPT, salt=None):
    return engine.generate([Request("r", prompt, PARAMS, tenant_salt=salt)])[0]


def test_a_second_engine_restores_what_the_first_computed(make_tiny_engine, store):
    cold = _run(make_tiny_engine())
    first = _run(make_tiny_engine(store=store.socket))
    assert first.stats.restored_tokens == 0 and first.stats.computed_tokens == 100
    second = _run(make_tiny_engine(store=store.socket))
    assert second.stats.restored_tokens == 96
    assert second.stats.computed_tokens == 4 and second.stats.reused_tokens == 0
    assert first.output_ids == second.output_ids == cold.output_ids


def test_another_tenant_restores_nothing(make_tiny_engine, store):
    _run(make_tiny_engine(store=store.socket), salt="a")
    other = _run(make_tiny_engine(store=store.socket), salt="b")
    assert other.stats.restored_tokens == 0 and other.stats.computed_tokens == 100
    same = _run(make_tiny_engine(store=store.socket), salt="a")
    assert same.stats.restored_tokens == 96


def test_a_dead_store_means_computing_not_failing(make_tiny_engine, store):
    cold = _run(make_tiny_engine())
    engine = make_tiny_engine(store=store.socket)
    store.stop(signal.SIGKILL)
    out = _run(engine)
    assert out.output_ids == cold.output_ids and out.stats.computed_tokens == 100
    assert engine.store is not None and not engine.store.available


def test_a_corrupted_entry_is_dropped_and_recomputed(tiny, make_tiny_engine, store):
    _, fingerprint = tiny
    cold = _run(make_tiny_engine())
    _run(make_tiny_engine(store=store.socket))
    first_key = block_key(KeyNamespace(fingerprint), None, PROMPT[:16])
    with store.client() as client:
        [hit] = client.acquire([first_key]).hits
    with (Path(SHM_DIR) / hit.name).open("r+b") as segment:
        segment.seek(100)
        segment.write(b"\xff" * 8)
    out = _run(make_tiny_engine(store=store.socket))
    assert out.output_ids == cold.output_ids
    assert out.stats.restored_tokens == 0 and out.stats.computed_tokens == 100
    with store.client() as client:  # the entry was dropped: a plain miss now
        got = client.acquire([first_key])
        assert got.hits == () and got.lead == (first_key,)


def test_a_store_that_dies_between_claim_and_publish_is_dropped_quietly(make_tiny_engine, store):
    engine = make_tiny_engine(store=store.socket)
    prompt = PROMPT[:20]  # one full block: the failing publish is its last claim
    seq = Sequence.from_request(Request("r", prompt, PARAMS))
    assert engine.kv.admit(seq)  # a miss: this engine now leads the prompt's full block
    store.stop(signal.SIGKILL)
    seq.num_computed = len(prompt)  # as if the runner had computed it
    engine.kv.register_full_blocks(seq)  # the publish fails: no error, the store is dropped
    engine.kv.free(seq)
    assert engine.store is not None and not engine.store.available
    other = tuple(random_tokens(70, seed=12))  # (the block above holds no real KV)
    cold = _run(make_tiny_engine(), prompt=other)
    assert _run(engine, prompt=other).output_ids == cold.output_ids  # it goes on without it
