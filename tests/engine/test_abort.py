"""Engine.abort on the tiny random Llama: wherever a request is, its blocks come back and nothing
more of it is computed."""

from kmesh.engine.request import Request, SamplingParams
from tests.conftest import random_tokens

LONG = SamplingParams(max_tokens=200, stop_token_ids=())


def request(request_id, seed, **options):
    return Request(request_id, tuple(random_tokens(40, seed=seed)), LONG, **options)


def test_an_aborted_running_request_frees_its_blocks_and_stops_computing(make_tiny_engine):
    engine = make_tiny_engine(block_size=16)
    engine.add_request(request("a", seed=1))
    engine.add_request(request("b", seed=2))
    for _ in range(3):
        engine.step()
    held = engine.kv.num_blocks_in_use
    assert engine.abort("a")
    assert engine.kv.num_blocks_in_use < held
    computed = engine.counters.computed_tokens
    while engine.has_unfinished():
        outputs = engine.step()
        assert all(output.request_id == "b" for output in outputs)
    # Only "b" ran after the abort: one token per step until its 200 were generated.
    assert engine.counters.computed_tokens - computed == 200 - 3
    assert engine.kv.num_blocks_in_use == 0
    assert not engine.abort("a")  # already gone


def test_an_aborted_waiting_request_never_runs(make_tiny_engine):
    engine = make_tiny_engine(block_size=16, max_seqs=1)
    engine.add_request(
        request(
            "a",
            seed=1,
        )
    )
    engine.add_request(request("b", seed=2))
    engine.step()
    assert [seq.request.request_id for seq in engine.scheduler.waiting] == ["b"]
    assert engine.abort("b")
    assert not engine.scheduler.waiting
    engine.abort("a")
    assert not engine.has_unfinished()
    assert engine.kv.num_blocks_in_use == 0


def test_aborting_a_family_releases_its_trunk_and_its_branches(make_tiny_engine):
    engine = make_tiny_engine(block_size=16)
    engine.declare_family("f", "t", 2)
    trunk = Request("t", tuple(random_tokens(37, seed=3)), None, retain=True)
    engine.add_request(trunk)
    for i in range(2):
        engine.add_request(Request(f"b{i}", (), LONG, parent_id="t"))
    engine.step()  # the trunk is retained and the branches start
    engine.step()
    assert engine.abort("b0")
    assert engine.kv.num_blocks_in_use > 0  # b1 and the trunk
    assert engine.abort("b1")  # the family's last branch: the trunk goes with it
    assert engine.kv.num_blocks_in_use == 0
    assert not engine.has_unfinished()


def test_aborting_a_trunk_before_it_is_computed_aborts_its_waiting_branches(make_tiny_engine):
    engine = make_tiny_engine(block_size=16)
    engine.declare_family("f", "t", 1)
    engine.add_request(Request("b0", (), LONG, parent_id="t"))
    engine.add_request(Request("t", tuple(random_tokens(37, seed=4)), None, retain=True))
    assert engine.abort("t")
    assert not engine.abort("b0")  # aborted with its trunk
    assert not engine.has_unfinished()
    assert engine.kv.num_blocks_in_use == 0
