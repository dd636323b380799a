"""The sampler's penalties, as vLLM defines them (engine/sampler.py)."""

import pytest
import torch

from kmesh.engine.request import SamplingParams
from kmesh.engine.sampler import penalized, sample
from kmesh.errors import InvalidRequestError

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])


def test_neutral_penalties_leave_the_logits_alone():
    assert penalized(LOGITS, SamplingParams(), [0, 1], [3]) is LOGITS


def test_frequency_and_presence_penalties_count_the_output_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = penalized(LOGITS, params, prompt_ids=[2], output_ids=[3, 3, 1])
    expected = LOGITS - torch.tensor([0.0, 0.75, 0.0, 1.25, 0.0])
    assert torch.equal(out, expected)


def test_repetition_penalty_shrinks_every_seen_token_toward_unlikely():
    out = penalized(LOGITS, SamplingParams(repetition_penalty=2.0), [0, 1], [4])
    assert torch.equal(out, torch.tensor([1.0, -2.0, 0.5, 3.0, -4.0]))


def test_greedy_takes_the_best_token_after_the_penalties_and_reports_its_model_logprob():
    params = SamplingParams(presence_penalty=2.0)
    token, logprob, top = sample(LOGITS, params, None, output_ids=[3])
    assert token == 0
    assert logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]))
    assert top == ()


def test_top_logprobs_are_the_models_most_likely_tokens_before_the_penalties():
    params = SamplingParams(presence_penalty=2.0, top_logprobs=2)
    token, _, top = sample(LOGITS, params, None, output_ids=[3])
    raw = torch.log_softmax(LOGITS, -1)
    assert token == 0  # token 3 is penalized, but is still the model's most likely
    assert [t for t, _ in top] == [3, 0]
    assert [lp for _, lp in top] == pytest.approx([float(raw[3]), float(raw[0])])


@pytest.mark.parametrize(
    "kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}]
)
def test_penalties_out_of_range_are_refused(kwargs):
    with pytest.raises(InvalidRequestError, match="penalty"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("narrow", [{"top_k": 2}, {"min_p": 0.3}])
def test_top_k_and_min_p_leave_only_the_likeliest_tokens(narrow):
    params = SamplingParams(temperature=1.0, **narrow)  # softmax of LOGITS: 0.25 / 0.68 at 0 / 3
    seen = {sample(LOGITS, params, torch.Generator().manual_seed(s))[0] for s in range(200)}
    assert seen == {0, 3}


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-300},  # greedy, as vLLM reads it
        {"temperature": 1e-4, "repetition_penalty": 1e-300},  # seen logits pushed to +-inf
        {"temperature": 1.0, "repetition_penalty": 1e300, "top_k": 1},
        {"temperature": 1e300, "min_p": 1.0},
        {"temperature": 0.5, "top_p": 1e-300, "presence_penalty": 2.0},
    ],
)
def test_extreme_sampling_values_pick_a_token_instead_of_failing(fields):
    params = SamplingParams(max_tokens=1, seed=0, **fields)
    generator = torch.Generator().manual_seed(0)
    token, logprob, _ = sample(LOGITS, params, generator, prompt_ids=[0, 1, 2, 3, 4])
    assert 0 <= token < len(LOGITS) and logprob <= 0


def test_nan_logits_are_never_sampled_and_all_nan_still_gives_a_token():
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    nan = torch.tensor([float("nan")] * 3 + [1.0, float("nan")])
    assert sample(nan, params, torch.Generator().manual_seed(0))[0] == 3
    all_nan = torch.full((5,), float("nan"))  # every token ruled out
    assert 0 <= sample(all_nan, params, torch.Generator().manual_seed(0))[0] < 5
