"""The fields of a request body that no engine reads as given: which are refused, and how the
rest (n, stop, logprobs, the prompt's form) are read, the same way for both engines.

A refusal is a RequestFieldError naming the field (`param` of OpenAI's error shape) with a
message that says what to send instead.
"""

from typing import Any

from kmesh.engine.request import MAX_TOP_LOGPROBS
from kmesh.errors import InvalidRequestError
from kmesh.serve.backend import Backend
from kmesh.serve.schema import ChatCompletionRequest, GenerationRequest

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Sampling fields of OpenAI's or vLLM's server that this one does not implement -> the values
# that change nothing. Those are accepted (ignored, like any unknown field); any other value is
# refused, never silently not honoured.
UNSUPPORTED_SAMPLING: dict[str, tuple[Any, ...]] = {
    "min_tokens": (0,),
    "logit_bias": ({},),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "prompt_logprobs": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
MAX_CHOICES = 16  # n


class RequestFieldError(InvalidRequestError):
    """A request field the server cannot serve as given; `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_model(model: str | None, backend: Backend) -> None:
    """A request's `model`, if given, must be the served one."""
    if model is not None and model != backend.model_id:
        raise RequestFieldError(
            f"model {model!r} is not served here: this server serves "
            f"{backend.model_id!r} (GET /v1/models); send that or leave model out",
            "model",
        )


def check_options(request: GenerationRequest, backend: Backend) -> None:
    """Refuse options this server does not serve as given (n, stop, response_format,
    unsupported sampling fields, tools) and a model it does not serve."""
    check_model(request.model, backend)
    if not 1 <= request.n <= MAX_CHOICES:
        raise RequestFieldError(
            f"n must be between 1 and {MAX_CHOICES} (got {request.n}): send several requests "
            "for more completions",
            "n",
        )
    stops = stop_strings(request)
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise RequestFieldError(
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {stops!r}", "stop"
        )
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise RequestFieldError(
            f"response_format {request.response_format.get('type')!r} is not supported: only "
            "plain text ({'type': 'text'}); leave it out",
            "response_format",
        )
    for name, neutral in UNSUPPORTED_SAMPLING.items():
        value = (request.model_extra or {}).get(name)
        if value is not None and value not in neutral:
            leave = "leave it out" + (f" (or send {neutral[0]!r})" if neutral else "")
            raise RequestFieldError(
                f"{name} is not supported by this server (got {value!r}): {leave}", name
            )
    if request.tools:
        raise RequestFieldError(
            "tools (function calling) are not supported: leave tools and tool_choice out",
            "tools",
        )


def stop_strings(request: GenerationRequest) -> tuple[str, ...]:
    """The request's `stop`: one string or a list of them."""
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())


def single_prompt(prompt: str | list[Any] | None) -> str | None:
    """`prompt` as one string (None: none given); a list of one string is that string."""
    if not isinstance(prompt, list):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise RequestFieldError(
        "prompt must be one string: this server takes one prompt per request (token ids and "
        "lists of prompts are not supported); send one request per prompt",
        "prompt",
    )


def requested_logprobs(request: GenerationRequest) -> int | None:
    """How many top tokens' log-probabilities the request wants per output token (None: no
    log-probabilities): completions say it in `logprobs`, chat in `logprobs: true` and
    `top_logprobs`, as OpenAI's API does."""
    chat = isinstance(request, ChatCompletionRequest)
    logprobs, top = request.logprobs, request.top_logprobs
    limits = f"an integer from 0 to {MAX_TOP_LOGPROBS}"
    if not chat:
        if top is not None:
            raise RequestFieldError(
                f"top_logprobs is a chat field: on /v1/completions send logprobs ({limits})",
                "top_logprobs",
            )
        if isinstance(logprobs, bool) or not (
            logprobs is None or 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise RequestFieldError(
                f"logprobs on /v1/completions is how many top tokens to list ({limits}), got "
                f"{logprobs!r}",
                "logprobs",
            )
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestFieldError(
            f"logprobs on chat completions is true or false, got {logprobs!r}: send "
            f"logprobs true and top_logprobs ({limits})",
            "logprobs",
        )
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestFieldError(f"top_logprobs must be {limits}, got {top}", "top_logprobs")
    if top is not None and not logprobs:
        raise RequestFieldError(
            "top_logprobs needs logprobs: send logprobs true with it", "top_logprobs"
        )
    return (top or 0) if logprobs else None
