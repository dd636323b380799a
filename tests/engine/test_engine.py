"""The reference engine on the tiny random Llama: sharing, isolation, batching, preemption."""

import pytest

from kmesh.engine.request import Request, SamplingParams
from kmesh.errors import ContractError, InvalidRequestError
from tests.conftest import random_tokens

GREEDY = SamplingParams(max_tokens=12)


def run_one(engine, tokens, params=GREEDY, salt=None, request_id="r"):
    return engine.generate([Request(request_id, tuple(tokens), params, salt)])[0]


def test_shared_prefix_is_reused_in_whole_blocks(make_tiny_engine):
    engine = make_tiny_engine(block_size=16)
    shared = random_tokens(70, seed=1)
    run_one(engine, shared + random_tokens(30, seed=2), request_id="a")
    second = run_one(engine, shared + random_tokens(25, seed=3), request_id="b")
    assert second.stats.reused_tokens == 64
    assert second.stats.computed_tokens == 95 - 64
    assert second.stats.prompt_tokens == 95


def test_reuse_gives_the_same_tokens_as_a_cold_engine(make_tiny_engine):
    warm = make_tiny_engine()
    shared = random_tokens(50, seed=4)
    prompt = shared + random_tokens(9, seed=5)
    run_one(warm, shared + random_tokens(11, seed=6), request_id="a")
    reused = run_one(warm, prompt, request_id="b")
    cold = run_one(make_tiny_engine(), prompt)
    assert reused.stats.reused_tokens > 0
    assert reused.output_ids == cold.output_ids


def test_the_last_token_is_computed_even_on_a_full_hit(make_tiny_engine):
    engine = make_tiny_engine(block_size=16)
    prompt = random_tokens(48, seed=7)
    first = run_one(engine, prompt, request_id="a")
    again = run_one(engine, prompt, request_id="b")
    assert again.stats.reused_tokens == 32
    assert again.stats.computed_tokens == 16
    assert again.output_ids == first.output_ids


def test_different_tenant_salts_never_share(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = random_tokens(80, seed=8)
    run_one(engine, prompt, salt="tenant-a", request_id="a")
    other = run_one(engine, prompt, salt="tenant-b", request_id="b")
    unsalted = run_one(engine, prompt, salt=None, request_id="c")
    same = run_one(engine, prompt, salt="tenant-a", request_id="d")
    assert other.stats.reused_tokens == 0
    assert unsalted.stats.reused_tokens == 0
    assert same.stats.reused_tokens == 64


def test_generated_tokens_become_reusable_prefix(make_tiny_engine):
    # A multi-turn caller sends the previous prompt + answer + a new turn.
    engine = make_tiny_engine(block_size=8)
    prompt = random_tokens(20, seed=9)
    first = run_one(engine, prompt, SamplingParams(max_tokens=30), request_id="a")
    turn = prompt + list(first.output_ids) + random_tokens(5, seed=10)
    second = run_one(engine, turn, request_id="b")
    assert second.stats.reused_tokens == (len(prompt) + len(first.output_ids) - 1) // 8 * 8
    assert second.stats.reused_tokens > len(prompt)


def test_a_batch_gives_the_same_tokens_as_one_at_a_time(make_tiny_engine):
    prompts = [random_tokens(n, seed=n) for n in (5, 33, 17, 64)]
    together = make_tiny_engine().generate(
        Request(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)
    )
    for prompt, out in zip(prompts, together, strict=True):
        assert out.output_ids == run_one(make_tiny_engine(), prompt).output_ids


def test_preemption_under_a_small_pool_keeps_outputs_exact(make_tiny_engine):
    params = SamplingParams(max_tokens=20)
    prompts = [random_tokens(20, seed=20 + i) for i in range(3)]
    requests = [Request(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)]
    small = make_tiny_engine(block_size=8, kv_cache_tokens=64)
    squeezed = small.generate(requests)
    roomy = make_tiny_engine().generate(requests)
    assert [o.output_ids for o in squeezed] == [o.output_ids for o in roomy]
    assert small.scheduler.num_preemptions > 0


def test_evicted_blocks_are_recomputed_correctly(make_tiny_engine):
    engine = make_tiny_engine(block_size=8, kv_cache_tokens=64)
    first_prompt = random_tokens(40, seed=30)
    first = run_one(engine, first_prompt, request_id="a")
    run_one(engine, random_tokens(50, seed=31), request_id="b")  # evicts most of a's blocks
    again = run_one(engine, first_prompt, request_id="c")
    assert again.stats.reused_tokens < 32
    assert again.output_ids == first.output_ids


def test_seeded_sampling_is_reproducible(make_tiny_engine):
    prompt = random_tokens(10, seed=40)

    def sample(seed):
        params = SamplingParams(max_tokens=16, temperature=2.0, seed=seed)
        return run_one(make_tiny_engine(), prompt, params).output_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_generation_stops_at_a_stop_token(make_tiny_engine):
    prompt = random_tokens(10, seed=41)
    free = run_one(make_tiny_engine(), prompt, SamplingParams(max_tokens=12, stop_token_ids=(999,)))
    stop = free.output_ids[3]
    stopped = run_one(
        make_tiny_engine(), prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop,))
    )
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(stop) + 1]
    assert stopped.finish_reason == "stop"
    assert free.finish_reason == "length"


def test_logprobs_are_the_models_log_probabilities(make_tiny_engine):
    out = run_one(make_tiny_engine(), random_tokens(10, seed=42))
    assert len(out.logprobs) == len(out.output_ids)
    assert all(lp <= 0 for lp in out.logprobs)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "empty"),
        ([5] * 4097, "context"),
        ([5, 256], "vocabulary"),
    ],
)
def test_bad_prompts_are_refused_with_a_clear_error(make_tiny_engine, tokens, message):
    with pytest.raises(InvalidRequestError, match=message):
        make_tiny_engine().add_request(Request("r", tuple(tokens), GREEDY))


@pytest.mark.parametrize(
    "options",
    [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0}, {"top_p": 0.0}],
)
def test_bad_sampling_params_are_refused(options):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**options)


def test_max_tokens_past_the_context_is_refused_not_clamped(make_tiny_engine):
    params = SamplingParams(max_tokens=4097)
    with pytest.raises(InvalidRequestError, match="max_tokens=4097 cannot be greater than the "):
        make_tiny_engine().add_request(Request("r", (5, 6), params))


def test_the_context_is_what_the_pool_holds_a_longer_prompt_is_refused_up_front(
    make_tiny_engine,
):
    engine = make_tiny_engine(block_size=8, kv_cache_tokens=32)
    assert (engine.context.tokens, engine.context.bound) == (32, "kv cache")
    with pytest.raises(InvalidRequestError, match="33 tokens but the engine's context is 32"):
        engine.add_request(Request("r", tuple(random_tokens(33, seed=1)), GREEDY))
    [out] = engine.generate([Request("r", tuple(random_tokens(30, seed=1)), GREEDY)])
    assert (len(out.output_ids), out.finish_reason) == (2, "length")  # up to the context


def test_a_live_request_id_cannot_be_reused(make_tiny_engine):
    engine = make_tiny_engine()
    engine.add_request(Request("r", (5, 6), GREEDY))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(Request("r", (7, 8), GREEDY))


def test_output_ids_show_a_live_requests_tokens_so_far(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = tuple(random_tokens(10, seed=11))
    engine.add_request(Request("r", prompt, GREEDY))
    assert engine.output_ids("r") == ()
    seen = []
    ended = []
    while not ended:
        ended = engine.step()
        if not ended:
            seen.append(engine.output_ids("r"))
    assert seen == [ended[0].output_ids[:n] for n in range(1, len(ended[0].output_ids))]
    with pytest.raises(ContractError, match="not running or waiting"):
        engine.output_ids("r")
