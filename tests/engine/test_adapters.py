"""Requests under LoRA adapters in the reference engine: exact, batched, and isolated by key."""

import pytest

from kmesh.engine.request import Request, SamplingParams
from kmesh.errors import ContractError, InvalidRequestError
from tests.conftest import random_tokens
from tests.random_lora import random_adapter

INVOCATION = (7, 8, 9)
GREEDY = SamplingParams(max_tokens=8, stop_token_ids=())


@pytest.fixture
def adapters(tiny):
    executor, _ = tiny
    made = [
        random_adapter(executor.config, seed=1, name="x"),
        random_adapter(executor.config, seed=2, name="y"),
        random_adapter(executor.config, seed=3, invocation=INVOCATION, name="ax"),
        random_adapter(executor.config, seed=4, invocation=INVOCATION, name="ay"),
    ]
    return {adapter.name: adapter for adapter in made}


@pytest.fixture
def make_engine(make_tiny_engine, adapters):
    def make(**options):
        return make_tiny_engine(block_size=4, adapters=adapters.values(), **options)

    return make


def _one(engine, request_id, prompt, adapter=None, **fields):
    [out] = engine.generate([Request(request_id, tuple(prompt), GREEDY, adapter=adapter, **fields)])
    return out


CONTEXT = random_tokens(24, seed=10, low=10)


def test_requests_under_several_adapters_in_one_batch_equal_each_one_alone(make_engine):
    engine = make_engine()
    names = ["x", None, "y", "ax"]
    prompt = [*CONTEXT, *INVOCATION, 11, 12]
    together = engine.generate(
        Request(f"r{i}", tuple(prompt), GREEDY, adapter=name) for i, name in enumerate(names)
    )
    for name, out in zip(names, together, strict=True):
        alone = _one(make_engine(prefix_caching=False), "solo", prompt, name)
        assert out.output_ids == alone.output_ids
    assert len({out.output_ids for out in together}) > 1  # the adapters do change the output


def test_state_never_crosses_adapters_or_reaches_the_base_model(make_engine):
    engine = make_engine()
    _one(engine, "under-x", CONTEXT, "x")
    assert _one(engine, "under-y", CONTEXT, "y").stats.reused_tokens == 0
    assert _one(engine, "base", CONTEXT).stats.reused_tokens == 0
    assert _one(engine, "under-x-again", CONTEXT, "x").stats.reused_tokens == 20


def test_an_activated_adapter_reuses_the_base_models_blocks_before_its_invocation(make_engine):
    engine = make_engine()
    _one(engine, "base", CONTEXT)
    prompt = [*CONTEXT, *INVOCATION, 11, 12]
    first = _one(engine, "ax", prompt, "ax")
    other = _one(engine, "ay", prompt, "ay")
    # The context's 6 blocks are base-model state; the invocation block is each adapter's own.
    assert first.stats.reused_tokens == 24 and other.stats.reused_tokens == 24
    cold = _one(make_engine(prefix_caching=False), "cold", prompt, "ax")
    assert first.output_ids == cold.output_ids
    assert first.output_ids != other.output_ids


def test_a_plain_adapter_never_reuses_base_blocks_even_before_an_invocation(make_engine):
    engine = make_engine()
    _one(engine, "base", CONTEXT)
    assert _one(engine, "x", [*CONTEXT, *INVOCATION, 11], "x").stats.reused_tokens == 0


def test_the_same_activated_adapter_starting_elsewhere_is_other_state(make_engine):
    engine = make_engine()
    early = [*CONTEXT[:6], *INVOCATION, *CONTEXT[9:], 11, 12]
    _one(engine, "early", early, "ax")
    # Same tokens up to the end, but a later invocation: blocks 0-1 are base, the rest differ.
    late = [*early, *INVOCATION, 13]
    out = _one(engine, "late", late, "ax")
    assert out.stats.reused_tokens == 4
    assert out.output_ids == _one(make_engine(prefix_caching=False), "cold", late, "ax").output_ids


def test_an_activated_adapter_may_fork_a_base_trunk_when_its_invocation_follows_it(make_engine):
    engine = make_engine()
    engine.declare_family("f", "trunk", 1)
    trunk = Request("trunk", tuple(CONTEXT), None, retain=True)
    branch = Request("b", (*INVOCATION, 11, 12), GREEDY, parent_id="trunk", adapter="ax")
    outputs = engine.generate([trunk, branch])
    cold = _one(make_engine(prefix_caching=False), "cold", [*CONTEXT, *INVOCATION, 11, 12], "ax")
    assert outputs[1].output_ids == cold.output_ids
    assert outputs[1].stats.reused_tokens == 24


@pytest.mark.parametrize(
    ("trunk_adapter", "branch_adapter", "branch_prompt"),
    [
        (None, "x", (11, 12)),  # a plain adapter would read base state as its own
        ("x", "y", (11, 12)),  # across adapters
        (None, "ax", (11, 12)),  # no invocation in the branch: it would start inside the trunk
        ("ax", None, (11, 12)),  # the base model reading an adapter's state
    ],
)
def test_a_fork_across_adapters_is_refused(
    make_engine, trunk_adapter, branch_adapter, branch_prompt
):
    engine = make_engine()
    engine.generate([Request("t", tuple(CONTEXT), None, retain=True, adapter=trunk_adapter)])
    with pytest.raises(ContractError, match="never crosses adapters"):
        engine.add_request(
            Request("b", branch_prompt, GREEDY, parent_id="t", adapter=branch_adapter)
        )


def test_a_branch_sent_before_a_trunk_of_another_adapter_is_refused_with_the_trunk(make_engine):
    engine = make_engine()
    engine.declare_family("f", "t", 1)
    engine.add_request(Request("b", (11, 12), GREEDY, parent_id="t", adapter="x"))
    with pytest.raises(ContractError, match="never crosses adapters"):
        engine.add_request(Request("t", tuple(CONTEXT), None, retain=True, adapter="y"))


def test_an_unknown_adapter_is_refused_naming_the_loaded_ones(make_engine):
    with pytest.raises(InvalidRequestError, match=r"'z' is not loaded \(loaded: ax, ay, x, y\)"):
        make_engine().add_request(Request("r", (1, 2, 3), GREEDY, adapter="z"))
