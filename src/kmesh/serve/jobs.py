"""From a validated request body to a GenerationJob: the prompt's token ids and the limits.

Everything an engine would refuse is refused here first, the same way for both engines, with a
message that says what to change (the options no engine reads: request_fields.py).
"""

from typing import Any

from kmesh.engine.llm import chat_prompt_ids, check_prompt_text
from kmesh.errors import ContractError, InvalidRequestError
from kmesh.serve.backend import Backend, GenerationJob
from kmesh.serve.request_fields import (
    RequestFieldError,
    check_options,
    requested_logprobs,
    single_prompt,
    stop_strings,
)
from kmesh.serve.schema import ChatCompletionRequest, CompletionRequest, GenerationRequest
from kmesh.state import chat_codec
from kmesh.state.recovery_meta import APPROX_SALT_PREFIX, RecoverySpec
from kmesh.state.request_meta import (
    KMESH_PARAMS_KEY,
    KMeshParams,
    MessageSpec,
    SegmentSpec,
    parse_kmesh_params,
    segment_spans,
    with_separated_segments,
)

DEFAULT_COMPLETION_TOKENS = 16
# The recovery `kmesh serve --reuse-messages` gives undeclared chats under approximate salts
# (its ratio: --reuse-ratio).
REUSE_MESSAGES = RecoverySpec(policy="kv_deviation")


def completion_job(request: CompletionRequest, backend: Backend) -> GenerationJob:
    """The job of a /v1/completions body: the prompt, or the kmesh segments' own tokens (then
    the prompt may be left out, or empty)."""
    check_options(request, backend)
    kmesh = kmesh_params(request)
    prompt = single_prompt(request.prompt)
    if kmesh is not None and kmesh.messages is not None:
        raise RequestFieldError(
            "kmesh.messages is taken on chat completions only: send kmesh.segments here",
            "kmesh.messages",
        )
    if kmesh is not None and kmesh.separator is not None:
        try:
            kmesh = with_separated_segments(kmesh, prompt)
        except InvalidRequestError as error:
            raise RequestFieldError(str(error), "kmesh.separator") from None
        prompt = kmesh.prompt_text
    if kmesh is not None and kmesh.segments is not None:
        # NOTE: "" counts as no prompt: the OpenAI client cannot leave `prompt` out.
        if prompt and prompt != kmesh.prompt_text:
            raise RequestFieldError(
                "prompt and kmesh.segments disagree: the prompt must be the segments' texts "
                "concatenated; send one of them, or make them equal",
                "prompt",
            )
        prompt_ids, _ = segment_spans(backend.tokenizer, kmesh)
    elif prompt is None:
        raise RequestFieldError(
            "prompt is missing: send prompt (a string) or kmesh.segments", "prompt"
        )
    else:
        check_prompt_text(prompt)
        prompt_ids = list(backend.tokenizer(prompt)["input_ids"])
    max_tokens = request.max_tokens or DEFAULT_COMPLETION_TOKENS
    return _job(request, backend, prompt_ids, max_tokens, kmesh, "prompt")


def chat_job(
    request: ChatCompletionRequest, backend: Backend, reuse: RecoverySpec | None = None
) -> GenerationJob:
    """The job of a /v1/chat/completions body: the messages in the model's chat template. With a
    kmesh object, each message is a segment (kmesh/state/chat_codec.py: the text the template
    adds for it, tokenized on its own), as `kmesh.messages` declares it, and the request is
    served as a completions request with those segments would be. `reuse` (`kmesh serve
    --reuse-messages`): a chat with no kmesh object under an approximate salt gets this
    recovery, every message but the last shared: any message another request of the tenant
    computed, or generated, is reused."""
    check_options(request, backend)
    kmesh = kmesh_params(request)
    if kmesh is None and reuse is not None and _approximate(request.cache_salt):
        shared = [MessageSpec(role="shared")] * (len(request.messages) - 1)
        kmesh = KMeshParams(
            messages=[*shared, MessageSpec(role="private")],
            recovery=reuse,
            keep_output=True,  # its answer, read back in later chats, is reused as its author's
        )
    if kmesh is not None and (kmesh.segments is not None or kmesh.separator is not None):
        name = "segments" if kmesh.segments is not None else "separator"
        raise RequestFieldError(
            f"kmesh.{name} is not taken on chat completions: send it to /v1/completions; chat "
            "requests take messages",
            f"kmesh.{name}",
        )
    if (
        request.max_tokens is not None
        and request.max_completion_tokens is not None
        and request.max_tokens != request.max_completion_tokens
    ):
        raise RequestFieldError(
            "max_tokens and max_completion_tokens disagree: send one of them", "max_tokens"
        )
    if not getattr(backend.tokenizer, "chat_template", None):
        raise RequestFieldError(
            f"model {backend.model_id!r} has no chat template: use /v1/completions", "messages"
        )
    messages = [
        {"role": m.template_role, "content": m.text, **({} if m.name is None else {"name": m.name})}
        for m in request.messages
    ]
    if kmesh is None:
        prompt_ids = chat_prompt_ids(backend.tokenizer, messages)
    else:
        kmesh = message_segments(kmesh, messages, backend.tokenizer)
        prompt_ids, _ = segment_spans(backend.tokenizer, kmesh)
    max_tokens = request.max_completion_tokens or request.max_tokens or backend.max_model_len
    return _job(request, backend, prompt_ids, max_tokens, kmesh, "messages")


def message_segments(
    kmesh: KMeshParams, messages: list[dict[str, str]], tokenizer: Any
) -> KMeshParams:
    """`kmesh` with one token-id segment per chat message (its declared id and role), then the
    generation prompt as the instruction."""
    declared: list[MessageSpec | None] = [None] * len(messages)
    if kmesh.messages is not None:
        declared = list(kmesh.messages)
    if len(declared) != len(messages):
        raise RequestFieldError(
            f"kmesh.messages declares {len(declared)} messages but the request has "
            f"{len(messages)}: give one entry per message, in order ({{}} for one without a "
            "declaration)",
            "kmesh.messages",
        )
    chat = []
    for message, spec in zip(messages, declared, strict=True):
        entry: dict[str, Any] = dict(message)
        if spec is not None and spec.id is not None:
            entry["id"] = spec.id
        if spec is not None and spec.role is not None:
            entry["kmesh_role"] = spec.role
        chat.append(entry)

    def render(plain: list[dict[str, str]], generation: bool) -> str:
        return str(
            tokenizer.apply_chat_template(plain, add_generation_prompt=generation, tokenize=False)
        )

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    try:
        prompt = chat_codec.decode(chat, render, tokenize)
    except ContractError as error:
        raise RequestFieldError(f"kmesh: {error}", "kmesh.messages") from None
    segments = [
        SegmentSpec(token_ids=list(s.token_ids), role=s.role.value, id=s.segment_id)
        for s in prompt.segments
    ]
    return kmesh.model_copy(update={"segments": segments, "messages": None})


def kmesh_params(request: GenerationRequest) -> KMeshParams | None:
    """The request's kmesh object, from `kmesh` or `kv_transfer_params.kmesh` (both must agree)."""
    transfer = request.kv_transfer_params
    if transfer is not None and set(transfer) - {KMESH_PARAMS_KEY}:
        others = sorted(set(transfer) - {KMESH_PARAMS_KEY})
        raise RequestFieldError(
            f"kv_transfer_params may only hold 'kmesh' here, not {others}: remove them",
            "kv_transfer_params",
        )
    given = []
    for field, value in (
        ("kmesh", request.kmesh),
        ("kv_transfer_params.kmesh", (transfer or {}).get(KMESH_PARAMS_KEY)),
    ):
        if value is not None:
            try:
                given.append(parse_kmesh_params(value))
            except InvalidRequestError as error:
                raise RequestFieldError(str(error), field) from None
    if len(given) == 2 and given[0] != given[1]:
        raise RequestFieldError(
            "kmesh and kv_transfer_params.kmesh disagree: send the kmesh object once",
            "kv_transfer_params",
        )
    return given[0] if given else None


def _approximate(cache_salt: str | None) -> bool:
    return (cache_salt or "").startswith(APPROX_SALT_PREFIX)


def _job(
    request: GenerationRequest,
    backend: Backend,
    prompt_ids: list[int],
    max_tokens: int,
    kmesh: KMeshParams | None,
    prompt_field: str,
) -> GenerationJob:
    outside = next((t for t in prompt_ids if not 0 <= t < backend.vocab_size), None)
    if outside is not None:  # only kmesh.segments' token_ids can hold one
        raise RequestFieldError(
            f"token id {outside} is outside the model's vocabulary [0, {backend.vocab_size}): "
            "send token ids of this model's tokenizer",
            "kmesh.segments",
        )
    room = backend.max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestFieldError(
            f"the prompt has {len(prompt_ids)} tokens but the engine's context is "
            f"{backend.max_model_len} tokens, prompt and output together: shorten the prompt",
            prompt_field,
        )
    return GenerationJob(
        prompt_ids=tuple(prompt_ids),
        max_tokens=min(max_tokens, room),
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        ignore_eos=request.ignore_eos,
        seed=request.seed,
        kmesh=kmesh,
        cache_salt=request.cache_salt,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        stop=stop_strings(request),
        logprobs=requested_logprobs(request),
    )
