"""What a request must be for the reference engine to take it, whatever the engine holds.

`check_request` raises InvalidRequestError with what to change: stop strings need an engine that
decodes, only a retained trunk may sample nothing, a prompt (other than a fork's) is not empty,
recovery is declared on a prompt and not on a fork, with spans, a check layer and a round the
model and the prompt can take (RecoveryRequest.check), the prompt fits the engine's context and
the model's vocabulary, and max_tokens is not above the context (vLLM's server refuses that too;
below it, generation ends where the context does). The context is never more than the KV pool
holds (kmesh/compute/context.py), so a request that passes fits the pool when it runs alone.
What depends on the engine's state (ids in use, families, forks across tenants or adapters) is
checked by the engine itself.
"""

from collections.abc import Callable

from kmesh.compute.config import ModelConfig
from kmesh.engine.request import Request
from kmesh.errors import InvalidRequestError


def check_request(
    request: Request,
    config: ModelConfig,
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
) -> None:
    if request.params is not None and request.params.stop and decode is None:
        raise InvalidRequestError(
            "stop strings need an engine that decodes: construct Engine(decode=...) with "
            "the tokenizer's decode (LLM and kmesh serve do)"
        )
    if request.params is None and not request.retain:
        raise InvalidRequestError(
            f"request {request.request_id!r} samples nothing (params=None): only a retained "
            "request (a trunk to fork) may do that"
        )
    if request.parent_id is None and not request.prompt_ids:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    if request.recovery is not None:
        if request.parent_id is not None:
            raise InvalidRequestError(
                "a fork shares its parent's exact state: it takes no recovery"
            )
        request.recovery.check(len(request.prompt_ids), config)
    n = len(request.prompt_ids)
    if n > max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens but the engine's context is {max_model_len} tokens: "
            "shorten the prompt"
        )
    bad = [t for t in request.prompt_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the model's vocabulary [0, {config.vocab_size})"
        )
    max_tokens = 0 if request.params is None else request.params.max_tokens
    if max_tokens > max_model_len:
        # NOTE: as vLLM's server does; up to the context, generation ends where the context does
        # (finish_reason "length").
        raise InvalidRequestError(
            f"max_tokens={max_tokens} cannot be greater than the engine's context of "
            f"{max_model_len} tokens (prompt and output together). Please request fewer "
            "output tokens."
        )
