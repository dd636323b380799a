"""The output limit of `kmesh serve`, on both engines, as vLLM 0.32's own server has it.

A `max_tokens` (chat: or `max_completion_tokens`) greater than the model's context is refused
with vLLM's message (vllm/renderers/params.py::TokenizeParams), before any work and before a
stream starts. One up to the context is clamped to the room the prompt leaves
(kmesh/serve/jobs.py), as vLLM's server does (vllm/entrypoints/serve/utils/api_utils.py::
get_max_tokens). Left out, a completion generates 16 tokens and a chat the room the prompt
leaves, vLLM's defaults too.
"""

from kmesh.serve.request_fields import RequestFieldError
from kmesh.serve.schema import ChatCompletionRequest, GenerationRequest


def check_max_tokens(request: GenerationRequest, max_model_len: int) -> None:
    """Raise RequestFieldError when the request asks for more output tokens than the model's
    context holds, prompt or not."""
    name, value = "max_tokens", getattr(request, "max_tokens", None)
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        name, value = "max_completion_tokens", request.max_completion_tokens
    if value is not None and value > max_model_len:
        raise RequestFieldError(
            f"{name}={value} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            name,
        )
