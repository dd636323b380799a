"""Copy-on-write forks on the tiny random Llama: exact against independent requests."""

import pytest
import torch

from kmesh.compute.executor import SequenceInput
from kmesh.engine.request import Request, SamplingParams
from kmesh.errors import ContractError, InvalidRequestError
from tests.conftest import random_tokens

ATOL = 1e-4  # see tests/compute/test_executor_tiny.py
SAMPLE = SamplingParams(max_tokens=9, temperature=1.0, stop_token_ids=())
PROMPT = tuple(random_tokens(37, seed=1))  # 2 full blocks of 16 and a partial one


def branch(i, parent="t", **options):
    return Request(
        f"b{i}", (), SamplingParams(**{**_fields(SAMPLE), "seed": i}), parent_id=parent, **options
    )


def _fields(params):
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def trunk_request(**options):
    return Request("t", PROMPT, None, retain=True, **options)


def independent(make_tiny_engine, prompt, seed):
    params = SamplingParams(**{**_fields(SAMPLE), "seed": seed})
    return make_tiny_engine().generate([Request("x", tuple(prompt), params, keep_logits=True)])[0]


def kv_of(engine, seq):
    slots = engine.cache.slots(seq.block_table, 0, seq.num_computed)
    return [engine.cache.read(layer, slots) for layer in range(engine.config.num_layers)]


def test_branches_equal_independent_requests_and_the_trunk_is_computed_once(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 3)
    trunk, *branches = engine.generate(
        [trunk_request(), *(branch(i, keep_logits=True) for i in range(3))]
    )
    assert trunk.finish_reason == "retained"
    for i, out in enumerate(branches):
        ref = independent(make_tiny_engine, PROMPT, seed=i)
        assert out.output_ids == ref.output_ids
        assert out.stats.reused_tokens == len(PROMPT) and out.stats.computed_tokens == 0
        for ours, theirs in zip(out.logits, ref.logits, strict=True):
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # The prompt once, then each branch computes its own tokens but the last.
    assert engine.counters.computed_tokens == len(PROMPT) + 3 * (SAMPLE.max_tokens - 1)


def test_writing_in_a_branch_changes_neither_the_trunk_nor_a_sibling(make_tiny_engine, tiny):
    executor, _ = tiny
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 3)
    engine.generate([trunk_request()])
    trunk = engine.retained("t")
    before = [(k.clone(), v.clone()) for k, v in kv_of(engine, trunk)]
    shared_tail = trunk.block_table[-1]
    for i in range(3):
        engine.declare_family(f"keep-{i}", f"b{i}", 1)  # keep each branch's KV to inspect it
    engine.generate([branch(i, retain=True) for i in range(3)])
    branches = [engine.retained(f"b{i}") for i in range(3)]
    tails = {seq.block_table[len(trunk.block_table) - 1] for seq in branches}
    assert shared_tail not in tails and len(tails) == 3  # each copied the partial block
    for (k0, v0), (k1, v1) in zip(before, kv_of(engine, trunk), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    for seq in branches:
        n = seq.num_computed
        full = executor.forward([SequenceInput(torch.tensor(seq.token_ids[:n]), torch.arange(n))])[
            0
        ]
        for layer, (k, v) in enumerate(kv_of(engine, seq)):
            torch.testing.assert_close(k, full.k[layer], atol=ATOL, rtol=0)
            torch.testing.assert_close(v, full.v[layer], atol=ATOL, rtol=0)


def test_reference_counts_return_to_zero_when_the_family_ends(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 4)
    engine.generate([trunk_request(), *(branch(i) for i in range(4))])
    pool = engine.kv.pool
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    assert engine.kv.num_blocks_in_use == 0
    with pytest.raises(ContractError, match="not retained"):
        engine.retained("t")


def test_pinned_trunk_survives_memory_pressure_and_is_evictable_after(make_tiny_engine):
    engine = make_tiny_engine(block_size=8, kv_cache_tokens=96)  # 12 blocks
    engine.declare_family("f", "t", 2)
    engine.generate([trunk_request(), branch(0)])  # the trunk (5 blocks) waits for branch 1
    trunk = engine.retained("t")
    before = [(k.clone(), v.clone()) for k, v in kv_of(engine, trunk)]
    # Pressure: a request that needs every block the trunk does not pin.
    pressure = Request("p", tuple(random_tokens(50, seed=7)), SamplingParams(max_tokens=6))
    engine.generate([pressure])
    assert all(engine.kv.pool.ref_count(b) == 1 for b in trunk.block_table)
    for (k0, v0), (k1, v1) in zip(before, kv_of(engine, trunk), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    [late] = engine.generate([branch(1)])
    assert late.output_ids == independent(make_tiny_engine, PROMPT, seed=1).output_ids
    # The family has ended: the trunk's blocks are free, and a request needing all 12 fits.
    assert engine.kv.num_blocks_in_use == 0
    engine.generate(
        [Request("all", tuple(random_tokens(90, seed=8)), SamplingParams(max_tokens=6))]
    )
    assert not any(engine.kv.index.is_indexed(b) for b in trunk.block_table[:4])


def test_fork_after_generated_reasoning_equals_recomputing_it(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 2)
    reasoning = SamplingParams(max_tokens=12, stop_token_ids=())
    trunk, *branches = engine.generate(
        [Request("t", PROMPT, reasoning, retain=True), branch(0), branch(1)]
    )
    assert len(trunk.output_ids) == 12
    for i, out in enumerate(branches):
        assert out.prompt_ids == PROMPT + trunk.output_ids
        ref = independent(make_tiny_engine, PROMPT + trunk.output_ids, seed=i)
        assert out.output_ids == ref.output_ids


def test_branches_may_be_sent_before_their_trunk(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 2)
    engine.add_request(branch(0))
    engine.add_request(branch(1))
    engine.add_request(trunk_request())
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert outputs["b1"].output_ids == independent(make_tiny_engine, PROMPT, seed=1).output_ids


def test_branches_with_their_own_tokens_compute_only_those(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 2)
    own = (tuple(random_tokens(5, seed=3)), tuple(random_tokens(20, seed=4)))
    greedy = SamplingParams(max_tokens=9)
    requests = [Request(f"b{i}", own[i], greedy, parent_id="t") for i in range(2)]
    _, *outs = engine.generate([trunk_request(), *requests])
    for i, out in enumerate(outs):
        assert out.stats.computed_tokens == len(own[i])
        cold = make_tiny_engine().generate([Request("x", PROMPT + own[i], greedy)])[0]
        assert out.output_ids == cold.output_ids


def test_one_token_branches_finish_without_computing(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 2)
    one = SamplingParams(max_tokens=1)
    _, a, b = engine.generate(
        [trunk_request(), *(Request(f"b{i}", (), one, parent_id="t") for i in range(2))]
    )
    assert len(a.output_ids) == len(b.output_ids) == 1
    assert engine.counters.computed_tokens == len(PROMPT)
    assert engine.kv.num_blocks_in_use == 0


def test_forks_survive_preemption_exactly(make_tiny_engine):
    engine = make_tiny_engine(block_size=8, kv_cache_tokens=80)
    engine.declare_family("f", "t", 4)
    long = SamplingParams(max_tokens=20, temperature=1.0, stop_token_ids=())
    _, *outs = engine.generate(
        [trunk_request()]
        + [
            Request(f"b{i}", (), SamplingParams(**{**_fields(long), "seed": i}), parent_id="t")
            for i in range(4)
        ]
    )
    assert engine.scheduler.num_preemptions > 0
    for i, out in enumerate(outs):
        params = SamplingParams(**{**_fields(long), "seed": i})
        ref = make_tiny_engine().generate([Request("x", PROMPT, params)])[0]
        assert out.output_ids == ref.output_ids


def test_closing_a_family_releases_its_trunk(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 5)
    engine.generate([trunk_request(), branch(0)])
    assert engine.kv.num_blocks_in_use > 0
    engine.close_family("f")
    assert engine.kv.num_blocks_in_use == 0
    with pytest.raises(ContractError, match="closed"):
        engine.add_request(branch(1))


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (branch(0, parent="nobody"), ContractError, "unknown state 'nobody'"),
        (Request("s", PROMPT, None), InvalidRequestError, "only a retained request"),
        (branch(0, tenant_salt="other"), ContractError, "another tenant salt"),
    ],
)
def test_bad_forks_are_refused(make_tiny_engine, request_, error, message):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    engine.generate([trunk_request()])
    with pytest.raises(error, match=message):
        engine.add_request(request_)


def test_more_branches_than_declared_are_refused(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    engine.add_request(trunk_request())
    engine.add_request(branch(0))
    with pytest.raises(ContractError, match="declared 1 branches"):
        engine.add_request(branch(1))


def test_a_declared_trunk_must_be_retained(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    with pytest.raises(ContractError, match="retain=True"):
        engine.add_request(Request("t", PROMPT, SAMPLE))


def test_branches_whose_trunk_never_comes_are_reported(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    with pytest.raises(ContractError, match="never sent"):
        engine.generate([branch(0)])


def test_a_trunk_of_another_tenant_than_its_early_branches_is_refused(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    engine.add_request(branch(0, tenant_salt="alice"))
    with pytest.raises(ContractError, match="another tenant salt"):
        engine.add_request(trunk_request(tenant_salt="bob"))


def test_a_fork_past_the_context_ends_with_length_and_nothing_generated(make_tiny_engine):
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    engine.generate([trunk_request()])
    too_long = Request("b", tuple(random_tokens(4096 - len(PROMPT), seed=2)), SAMPLE, parent_id="t")
    [out] = engine.generate([too_long])
    assert out.finish_reason == "length" and out.output_ids == ()
    assert engine.kv.num_blocks_in_use == 0
