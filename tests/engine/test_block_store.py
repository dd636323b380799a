"""The reference engine with a store: restore on a local miss, publish after computing, fall back
to computing on every store failure. Tiny model, real store process."""

import json
import signal
import threading
import time
from pathlib import Path

from kmesh.engine.kv_manager import Admission
from kmesh.engine.request import Request, SamplingParams
from kmesh.engine.sequence import Sequence
from kmesh.state.keys import KeyNamespace, block_key
from kmesh.store.client import STORE_KEY_ENV
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
    assert (
        engine.kv.admit(seq) is Admission.ADMITTED
    )  # a miss: this engine now leads the prompt's full block
    store.stop(signal.SIGKILL)
    seq.num_computed = len(prompt)  # as if the runner had computed it
    engine.kv.register_full_blocks(seq)  # the publish fails: no error, the store is dropped
    engine.kv.free(seq)
    assert engine.store is not None and not engine.store.available
    other = tuple(random_tokens(70, seed=12))  # (the block above holds no real KV)
    cold = _run(make_tiny_engine(), prompt=other)
    assert _run(engine, prompt=other).output_ids == cold.output_ids  # it goes on without it


def _keys(engine, prompt=PROMPT):
    seq = Sequence.from_request(Request("probe", prompt, PARAMS))
    engine.kv.extend_keys(seq, (len(prompt) - 1) // engine.kv.block_size)
    return [bytes(key) for key in seq.block_keys]


def test_a_request_waiting_for_another_engines_blocks_does_not_hold_up_the_others(
    make_tiny_engine, store
):
    cold = _run(make_tiny_engine())
    engine = make_tiny_engine(store=store.socket)
    with store.client() as other:
        assert other.acquire(_keys(engine)).lead  # another engine computes PROMPT's blocks
        engine.add_request(Request("waits", PROMPT, PARAMS))
        engine.add_request(Request("goes", tuple(random_tokens(40, seed=13)), PARAMS))
        done = []
        while not done:
            done = [o.request_id for o in engine.step()]
        assert done == ["goes"]  # it ran to its end while "waits" waited
        assert [s.request.request_id for s in engine.scheduler.waiting] == ["waits"]
        other.abandon(_keys(engine))  # the other engine goes away: this one takes over
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    [waited] = outputs
    assert waited.output_ids == cold.output_ids and waited.stats.computed_tokens == 100


def test_a_request_stops_waiting_after_wait_seconds_and_computes(make_tiny_engine, store):
    cold = _run(make_tiny_engine())
    engine = make_tiny_engine(store=store.socket)
    engine.store.wait_seconds = 0.3
    with store.client() as other:
        other.acquire(_keys(engine))  # and never publishes
        started = time.monotonic()
        out = _run(engine)
        assert time.monotonic() - started >= 0.3
        assert out.output_ids == cold.output_ids and out.stats.computed_tokens == 100
        assert other.stats()["published"] == 0  # it led nothing of what it did not wait for


def test_claims_survive_a_model_step_longer_than_the_lease(make_tiny_engine, store_factory):
    store = store_factory(lease=1.0)
    engine = make_tiny_engine(store=store.socket)
    step = engine.runner.step

    def slow_step(batch):
        time.sleep(2.0)
        return step(batch)

    engine.runner.step = slow_step
    seen = {}

    def look_during_the_step():
        time.sleep(1.5)  # past the lease: only a renewal keeps this engine's claims
        with store.client() as other:
            seen["got"] = other.acquire(_keys(engine)[:1])

    looker = threading.Thread(target=look_during_the_step)
    looker.start()
    out = _run(engine)
    looker.join()
    assert seen["got"].waiting_on == _keys(engine)[0]  # still claimed by the engine
    assert out.stats.computed_tokens == 100


def test_engines_of_two_keys_share_one_store_and_never_each_others_state(
    make_tiny_engine, store_factory, tmp_path, monkeypatch
):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-of-team-a": "a", "key-of-team-b": "b"}))
    store = store_factory(api_keys=keys)
    cold = _run(make_tiny_engine())

    def engine_with(key):
        if key is None:
            monkeypatch.delenv(STORE_KEY_ENV, raising=False)
        else:
            monkeypatch.setenv(STORE_KEY_ENV, key)
        return make_tiny_engine(store=store.socket)

    assert _run(engine_with("key-of-team-a")).stats.computed_tokens == 100
    other = _run(engine_with("key-of-team-b"))  # the same prompt and salt, another key
    assert other.stats.restored_tokens == 0 and other.output_ids == cold.output_ids
    assert _run(engine_with("key-of-team-a")).stats.restored_tokens == 96
    keyless = engine_with(None)
    out = _run(keyless)  # refused by the store: it computes without it
    assert out.output_ids == cold.output_ids and not keyless.store.available
