"""Request bodies to generation jobs: limits against the model's context, the kmesh object."""

from types import SimpleNamespace

import pytest

from kmesh.serve.jobs import chat_job, completion_job
from kmesh.serve.request_fields import RequestFieldError
from kmesh.serve.schema import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def small_context(real_model):
    """A backend stand-in whose model has a 20-token context."""
    return SimpleNamespace(
        engine="reference",
        model_id="m",
        tokenizer=real_model.tokenizer,
        max_model_len=20,
        vocab_size=real_model.config.vocab_size,
    )


def test_max_tokens_is_cut_to_the_room_the_context_leaves(small_context):
    prompt = "one two three four five"
    n = len(small_context.tokenizer(prompt)["input_ids"])
    job = completion_job(CompletionRequest(prompt=prompt, max_tokens=100), small_context)
    assert job.max_tokens == 20 - n
    assert len(job.prompt_ids) == n


def test_a_prompt_that_fills_the_context_is_refused(small_context):
    with pytest.raises(RequestFieldError, match="context is 20 tokens") as error:
        completion_job(CompletionRequest(prompt="word " * 20), small_context)
    assert error.value.param == "prompt"


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(small_context):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(RequestFieldError, match="shorten the prompt"):
        chat_job(request, small_context)  # the template's system prompt alone is longer
    roomy = SimpleNamespace(**{**vars(small_context), "max_model_len": 200})
    job = chat_job(request, roomy)
    assert job.max_tokens == 200 - len(job.prompt_ids)


def test_kmesh_params_and_salt_reach_the_job(small_context):
    request = CompletionRequest(prompt="Hi", kmesh={"family": "f", "branches": 3}, cache_salt="t")
    job = completion_job(request, small_context)
    assert job.kmesh is not None and (job.kmesh.family, job.kmesh.branches) == ("f", 3)
    assert job.cache_salt == "t"
    assert (job.temperature, job.top_p, job.seed) == (1.0, 1.0, None)


def test_a_separated_prompt_becomes_explicit_segments(small_context):
    roomy = SimpleNamespace(**{**vars(small_context), "max_model_len": 200})
    kmesh = {"separator": " # # ", "recovery": {"policy": "full"}}
    job = completion_job(
        CompletionRequest(prompt="Alpha beta # # Gamma # # Ask", kmesh=kmesh), roomy
    )
    assert job.kmesh is not None and job.kmesh.separator is None
    segments = job.kmesh.segments or []
    assert [(s.text, s.role) for s in segments] == [
        ("Alpha beta", "shared"),
        ("Gamma", "shared"),
        ("Ask", "instruction"),
    ]
    tokenize = small_context.tokenizer
    parts = [
        tokenize(t, add_special_tokens=False)["input_ids"] for t in ("Alpha beta", "Gamma", "Ask")
    ]
    assert list(job.prompt_ids) == [t for part in parts for t in part]  # no separator tokens


@pytest.mark.parametrize(
    ("prompt", "kmesh", "wrong"),
    [
        ("A # #  # # B", {"separator": " # # "}, "empty"),  # two separators in a row
        ("A # # B", {"separator": " # # ", "segments": [{"text": "A"}]}, "give one of"),
    ],
)
def test_a_bad_separated_prompt_is_refused_with_the_reason(small_context, prompt, kmesh, wrong):
    with pytest.raises(RequestFieldError, match=wrong):
        completion_job(CompletionRequest(prompt=prompt, kmesh=kmesh), small_context)
