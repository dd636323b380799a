"""vLLM's /tokenize and /detokenize on `kmesh serve` (vLLM's own clients, `vllm bench serve`
among them, call them): the same request and response fields, the served model's tokenizer."""

from typing import Any

from kmesh.serve.backend import Backend
from kmesh.serve.request_fields import RequestFieldError, check_model
from kmesh.serve.schema import DetokenizeRequest, TokenizeRequest


def tokenize(body: TokenizeRequest, backend: Backend) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"} of the prompt or the chat."""
    check_model(body.model, backend)
    tokenizer = backend.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise RequestFieldError("send one of prompt (a string) and messages (a chat)", "prompt")
    if body.messages is not None:
        messages = [{"role": m.template_role, "content": m.text} for m in body.messages]
        tokens = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
        )
        ids = list(tokens["input_ids"] if hasattr(tokens, "keys") else tokens)
    else:
        ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": backend.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(body: DetokenizeRequest, backend: Backend) -> dict[str, Any]:
    """{"prompt"}: the text of the token ids."""
    check_model(body.model, backend)
    vocab = len(backend.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestFieldError(
            f"tokens {bad[:5]} are not in the model's vocabulary (ids 0 to {vocab - 1})", "tokens"
        )
    return {"prompt": str(backend.tokenizer.decode(body.tokens))}
