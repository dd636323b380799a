"""The OpenAI request bodies `kmesh serve` accepts, and the response objects it returns.

Types are strict (a number in quotes is refused). An explicit `null` means the field is absent
(as OpenAI's and vLLM's servers read it). Fields this server does not know are kept aside
(`unknown_fields`): the app ignores and logs them, as vLLM's server does, or refuses them in strict
mode. `kmesh` and `kv_transfer_params` are checked by kmesh.serve.jobs (with
kmesh.state.request_meta), not here.

Every string of a body, keys included, must be Unicode text. JSON's \\u escapes can carry a lone
surrogate ("\\ud800", half of a UTF-16 pair), which no tokenizer, log or UTF-8 answer takes: such
a body is refused with a 400 (kmesh/serve/errors.py words it).
"""

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from kmesh.serve.unicode_text import NOT_UNICODE, lone_surrogate


class _Body(BaseModel):
    """Strict types, `null` read as absent, unknown fields kept in `model_extra`, Unicode text
    only."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            ctx = {"field": found.field, "index": found.index, "code": found.code}
            raise PydanticCustomError(NOT_UNICODE, "the text is not valid Unicode", ctx)
        return data


class StreamOptions(_Body):
    include_usage: bool = Field(
        default=False,
        description="End the stream with a chunk that has no choices and the usage, before "
        "`data: [DONE]` (OpenAI's).",
    )


class GenerationRequest(_Body):
    model: str | None = Field(
        default=None,
        description="The served model's id (`GET /v1/models`); any other is refused.",
    )
    temperature: float = Field(default=1.0, ge=0, description="0 is greedy.")
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Sample from the most likely tokens of this mass."
    )
    # vLLM's extra sampling fields (kmesh/engine/sampler.py).
    top_k: int = Field(
        default=0, ge=-1, description="vLLM's: keep the k most likely tokens; -1 or 0: all."
    )
    min_p: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="vLLM's: drop the tokens less likely than this times the most likely one.",
    )
    ignore_eos: bool = Field(
        default=False,
        description="vLLM's: end-of-sequence tokens do not end generation (it runs to the "
        "token limit).",
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        lt=2**63,
        description="Sampling seed; with `n` > 1, choice i samples with seed + i.",
    )
    stream: bool = Field(default=False, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = Field(
        default=None, description="With `stream`: OpenAI's stream options."
    )
    stop: str | list[str] | None = Field(
        default=None,
        description="Up to 4 non-empty strings; generation ends at the first one (cut from "
        "the text), with finish reason `stop`.",
    )
    # kmesh.serve.app: its branches share the prompt's prefix.
    n: int = Field(
        default=1,
        description="Completions of the prompt, 1 to 16; their prompt's work is shared.",
    )
    # vLLM's sampling penalties (kmesh/engine/sampler.py has their definitions).
    presence_penalty: float = Field(
        default=0.0, ge=-2, le=2, description="OpenAI's and vLLM's presence penalty."
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2, le=2, description="OpenAI's and vLLM's frequency penalty."
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0, description="vLLM's repetition penalty (1: none)."
    )
    # kmesh.serve.jobs checks which is which (kmesh/serve/logprobs.py renders them).
    logprobs: bool | int | None = Field(
        default=None,
        description="Completions: a number k from 0 to 20, the chosen token's log-probability "
        "and the k most likely tokens'; chat: `true`, with `top_logprobs`.",
    )
    top_logprobs: int | None = Field(
        default=None,
        description="Chat only, with `logprobs: true`: how many most likely tokens to list, "
        "0 to 20.",
    )
    response_format: dict[str, Any] | None = Field(
        default=None, description='Only `{"type": "text"}`; any other type is refused.'
    )
    tools: list[Any] | None = Field(
        default=None, description="Refused unless empty: function calling is not supported."
    )
    tool_choice: Any = Field(default=None, description="Ignored.")
    user: str | None = Field(default=None, description="Accepted and ignored.")
    kmesh: dict[str, Any] | None = Field(
        default=None,
        description="The `kmesh` object (above): the request's family, segments and recovery.",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="The request's namespace: state never crosses salts (with `--api-keys`, a "
        "namespace within the key's tenant); `kmesh-approx...` admits approximate recovery.",
    )
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None,
        description='vLLM\'s field: only `{"kmesh": {...}}`, another way to send the `kmesh` '
        "object.",
    )


class CompletionRequest(GenerationRequest):
    prompt: str | list[Any] | None = Field(
        default=None,
        description="One string (a list holding one string is accepted); may be left out, or "
        '`""`, with `kmesh.segments`.',
    )
    max_tokens: int | None = Field(
        default=16,
        ge=1,
        description="Tokens to generate at most, up to the model's context; clamped to the "
        "room the prompt leaves.",
    )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="`developer` is OpenAI's newer name for system instructions: the chat "
        "template gets `system`."
    )
    content: str | list[TextPart] = Field(
        description="The message's text, or its text parts (concatenated)."
    )
    name: str | None = Field(
        default=None,
        min_length=1,
        description="The speaker's name (OpenAI's), handed to the chat template with the message.",
    )

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation, in the model's chat template."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens to generate at most, up to the model's context; absent: as many "
        "as the context leaves after the prompt (as OpenAI).",
    )
    max_completion_tokens: int | None = Field(
        default=None,
        ge=1,
        description="OpenAI's newer name for `max_tokens` (both given: they must agree).",
    )


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize: a prompt, or chat messages in the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The fields of `body` (and of the bodies inside it) this server does not know, dotted."""
    found = [f"{prefix}{name}" for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                found += unknown_fields(item, where)
    return found


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# One choice of a whole response: its text, finish reason and logprobs object (or None).
Choice = tuple[str, str, dict[str, Any] | None]


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What differs between text completions and chat completions."""

    id_prefix: str
    object: str
    chunk_object: str
    # Chat: the text is a message (a delta in chunks), not a plain "text" field.
    is_chat: bool


COMPLETION = ResponseShape("cmpl", "text_completion", "text_completion", is_chat=False)
CHAT = ResponseShape("chatcmpl", "chat.completion", "chat.completion.chunk", is_chat=True)


@dataclass(frozen=True, slots=True)
class ResponseBuilder:
    """One response's objects: the whole response, or its stream's chunks (same id)."""

    shape: ResponseShape
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, shape: ResponseShape, model: str) -> "ResponseBuilder":
        return cls(shape, model, f"{shape.id_prefix}-{uuid.uuid4().hex}", int(time.time()))

    def response(self, choices: list[Choice], **extra: Any) -> dict[str, Any]:
        """The whole response: each choice's text, finish reason and logprobs object (or
        None); `extra` holds usage and kmesh."""
        bodies = []
        for index, (text, finish_reason, logprobs) in enumerate(choices):
            if self.shape.is_chat:
                content: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
            else:
                content = {"text": text}
            bodies.append(_choice(content, finish_reason, index, logprobs))
        return {**self._body(self.shape.object, None, extra), "choices": bodies}

    def opening_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """The chunk a stream starts each choice with before any text: chat names the role."""
        if not self.shape.is_chat:
            return None
        choice = _choice({"delta": {"role": "assistant", "content": ""}}, None, index)
        return self._body(self.shape.chunk_object, choice, {})

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        **extra: Any,
    ) -> dict[str, Any]:
        """A chunk of choice `index`'s new text (and its tokens' logprobs object); its last
        one has finish_reason; `extra`: kmesh."""
        if self.shape.is_chat:
            content: dict[str, Any] = {"delta": {"content": text} if text else {}}
        else:
            content = {"text": text}
        choice = _choice(content, finish_reason, index, logprobs)
        return self._body(self.shape.chunk_object, choice, extra)

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """A stream's usage (`stream_options.include_usage`): OpenAI's last chunk, no choices."""
        return {**self._body(self.shape.chunk_object, None, {}), "choices": [], "usage": usage}

    def _body(
        self, kind: str, choice: dict[str, Any] | None, extra: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
            **extra,
        }


def _choice(
    content: dict[str, Any],
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
