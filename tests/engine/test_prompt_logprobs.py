"""Prompt log-probabilities (SamplingParams.prompt_logprobs) on the tiny random Llama, against a
direct Executor forward of the whole token sequence.

NOTE on tolerance: the engine and the reference run the same float32 kernels on the same tokens;
only the batch composition differs (which rows go through the projections and the lm_head
together, a cached prefix read as context), which may reorder sums. Measured on this CPU: no
difference at all (0.0 on 55- and 200-token prompts, with a prefix hit); the same-kernel bound of
tests/compute/test_executor_tiny.py (1e-4) leaves room for other GEMM tilings and still catches a
row off by one position (1.9 to 2.6 here).
"""

import pytest
import torch

from kmesh.compute.executor import SequenceInput
from kmesh.engine import prompt_logprobs
from kmesh.engine.request import MAX_TOP_LOGPROBS, Request, SamplingParams
from kmesh.errors import InvalidRequestError
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.segments import Role, Span
from tests.conftest import random_tokens

ATOL = 1e-4
K = 5
ASK = SamplingParams(max_tokens=3, prompt_logprobs=K)


def reference(executor, tokens):
    """log_softmax of the logits after each token, [len(tokens), vocab], from one forward."""
    ids = torch.tensor(tokens)
    out = executor.forward([SequenceInput(ids, torch.arange(len(tokens)))])[0]
    return torch.log_softmax(executor.logits(out.hidden), dim=-1)


def assert_entry(entry, expected, token, k=K):
    """`entry` is the k most likely tokens of `expected` [vocab] plus `token`, with its values."""
    assert entry is not None and token in entry
    kth = torch.topk(expected, k).values[-1] if k else float("inf")
    assert len(entry) == (k if expected[token] >= kth else k + 1)
    for token_id, value in entry.items():
        assert value == pytest.approx(float(expected[token_id]), abs=ATOL)
        if token_id != token:
            assert expected[token_id] >= kth - ATOL


def test_a_fresh_prompt_matches_a_direct_forward_at_every_position(make_tiny_engine, tiny):
    executor, _ = tiny
    prompt = random_tokens(40, seed=1)
    out = make_tiny_engine().generate([Request("r", tuple(prompt), ASK)])[0]
    expected = reference(executor, prompt)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert_entry(out.prompt_logprobs[i], expected[i - 1], prompt[i])


def test_k_zero_gives_the_prompt_token_alone(make_tiny_engine, tiny):
    executor, _ = tiny
    prompt = random_tokens(12, seed=2)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = make_tiny_engine().generate([Request("r", tuple(prompt), params)])[0]
    expected = reference(executor, prompt)
    assert out.prompt_logprobs is not None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i] == {
            prompt[i]: pytest.approx(float(expected[i - 1, prompt[i]]), abs=ATOL)
        }


def test_prefix_cache_hits_are_none_and_the_rest_exact(make_tiny_engine, tiny):
    executor, _ = tiny
    engine = make_tiny_engine(block_size=16)
    shared = random_tokens(40, seed=3)
    prompt = shared + random_tokens(15, seed=5)
    engine.generate([Request("a", tuple(shared + random_tokens(9, seed=4)), ASK, "t")])
    out = engine.generate([Request("b", tuple(prompt), ASK, "t")])[0]
    hit = out.stats.reused_tokens
    assert hit == 32
    assert out.prompt_logprobs is not None
    # Position i needs row i - 1: rows below the hit came from the cache.
    assert all(entry is None for entry in out.prompt_logprobs[: hit + 1])
    expected = reference(executor, prompt)
    for i in range(hit + 1, len(prompt)):
        assert_entry(out.prompt_logprobs[i], expected[i - 1], prompt[i])


def test_every_chunk_of_logits_rows_is_collected(make_tiny_engine, tiny, monkeypatch):
    executor, _ = tiny
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_CHUNK", 7)
    prompt = random_tokens(45, seed=6)
    out = make_tiny_engine().generate([Request("r", tuple(prompt), ASK)])[0]
    expected = reference(executor, prompt)
    assert out.prompt_logprobs is not None
    for i in range(1, len(prompt)):
        assert_entry(out.prompt_logprobs[i], expected[i - 1], prompt[i])


def test_entries_survive_preemption_and_recomputation(make_tiny_engine, tiny):
    executor, _ = tiny
    params = SamplingParams(max_tokens=20, prompt_logprobs=K)
    prompts = [random_tokens(20, seed=10 + i) for i in range(3)]
    small = make_tiny_engine(block_size=8, kv_cache_tokens=64)
    outs = small.generate(Request(f"r{i}", tuple(p), params) for i, p in enumerate(prompts))
    assert small.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        expected = reference(executor, prompt)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert_entry(out.prompt_logprobs[i], expected[i - 1], prompt[i])


def test_a_fork_covers_its_own_tokens_the_first_from_the_held_logits(make_tiny_engine, tiny):
    executor, _ = tiny
    trunk = random_tokens(37, seed=7)
    own = random_tokens(11, seed=8)
    engine = make_tiny_engine()
    engine.declare_family("f", "t", 1)
    parent = Request("t", tuple(trunk), None, retain=True)
    _, out = engine.generate([parent, Request("b", tuple(own), ASK, parent_id="t")])
    expected = reference(executor, trunk + own)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(own)
    for j, token in enumerate(own):
        assert_entry(out.prompt_logprobs[j], expected[len(trunk) + j - 1], token)


def test_rows_filled_by_recovery_give_none(make_tiny_engine):
    system, ask = random_tokens(20, seed=9), random_tokens(5, seed=10)
    spans = (
        Span(0, 20, Role.SHARED, "system"),
        Span(20, 25, Role.INSTRUCTION, "ask"),
    )
    recovery = RecoveryRequest(spans, RecoverySpec(policy="full"), "council")
    request = Request("r", tuple(system + ask), ASK, recovery=recovery)
    out = make_tiny_engine().generate([request])[0]
    assert out.stats.recovered_tokens == len(request.prompt_ids) - 1
    assert out.prompt_logprobs == (None,) * len(request.prompt_ids)


@pytest.mark.parametrize("k", [-1, MAX_TOP_LOGPROBS + 1])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(InvalidRequestError, match=rf"prompt_logprobs must be .*got {k}"):
        SamplingParams(prompt_logprobs=k)


def test_a_request_that_does_not_ask_gets_none_and_no_extra_logits(
    make_tiny_engine, tiny, monkeypatch
):
    executor, _ = tiny
    rows = []
    logits = executor.logits

    def counted(hidden):
        rows.append(len(hidden))
        return logits(hidden)

    monkeypatch.setattr(executor, "logits", counted)
    prompt = tuple(random_tokens(30, seed=11))
    plain = SamplingParams(max_tokens=3)
    out = make_tiny_engine().generate([Request("r", prompt, plain)])[0]
    assert out.prompt_logprobs is None
    assert rows == [1, 1, 1]  # the last row of each step: the prefill and two decodes
    rows.clear()
    make_tiny_engine().generate([Request("r", prompt, ASK)])[0]
    assert sum(rows) == 3 + len(prompt) - 1
