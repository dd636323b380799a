"""The output limit both engines of `kmesh serve` share (kmesh/serve/output_limit.py)."""

import pytest

from kmesh.serve.output_limit import check_max_tokens
from kmesh.serve.request_fields import RequestFieldError
from kmesh.serve.schema import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "request_",
    [
        CompletionRequest(prompt="x"),  # 16 by default
        CompletionRequest(prompt="x", max_tokens=None),
        CompletionRequest(prompt="x", max_tokens=64),
        ChatCompletionRequest(messages=CHAT),  # the room the prompt leaves
        ChatCompletionRequest(messages=CHAT, max_tokens=64, max_completion_tokens=64),
    ],
)
def test_max_tokens_up_to_the_context_is_taken(request_):
    check_max_tokens(request_, 64)


def test_max_tokens_past_the_context_is_refused_in_vllms_words():
    with pytest.raises(RequestFieldError) as refused:
        check_max_tokens(CompletionRequest(prompt="x", max_tokens=65), 64)
    assert str(refused.value) == (
        "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens."
    )
    assert refused.value.param == "max_tokens"


def test_chat_names_max_completion_tokens_when_that_is_what_was_sent():
    request = ChatCompletionRequest(messages=CHAT, max_completion_tokens=65)
    with pytest.raises(RequestFieldError, match=r"^max_completion_tokens=65 cannot") as refused:
        check_max_tokens(request, 64)
    assert refused.value.param == "max_completion_tokens"
