"""An engine's context length (vLLM's `max_model_len`): what a command asked for, or the model's
own, bounded by what the engine's KV cache holds. No tensors, no engine: every command resolves
it before an engine starts, so a length the model or the cache cannot take is refused in one line.

Invariants:
- `tokens` <= the model's context (`max_position_embeddings` as the description reads it);
- `tokens` <= the KV cache's capacity as the engine plans it: for vLLM, whole pages of every
  layer after the null block its pool holds back (vLLM's own start check,
  `check_enough_kv_cache_memory`), per tensor-parallel worker; for the reference engine, its pool
  in whole blocks;
- `bound` names which of the three set `tokens`: "--max-model-len" (asked for, and within both),
  "model" or "kv cache" (nothing asked for: the smaller of the two).
"""

from dataclasses import dataclass
from typing import Literal

from kmesh.compute.config import ModelConfig
from kmesh.errors import InvalidRequestError

Bound = Literal["--max-model-len", "model", "kv cache"]


@dataclass(frozen=True, slots=True)
class Context:
    tokens: int  # prompt and output together
    bound: Bound  # what set it (module docstring)
    model_tokens: int  # the model's own context
    cache_tokens: int  # what the KV cache holds

    def describe(self) -> str:
        """For a start line: the length and which bound set it."""
        if self.bound == "model":
            return f"context {self.tokens} tokens (the model's)"
        if self.bound == "kv cache":
            return (
                f"context {self.tokens} tokens (what the KV cache holds; the model's is "
                f"{self.model_tokens}: raise the KV cache for more)"
            )
        return f"context {self.tokens} tokens (--max-model-len; the model's is {self.model_tokens})"


def kv_bytes_per_token(config: ModelConfig, dtype: str, tensor_parallel_size: int = 1) -> int:
    """One token's K and V over every layer on one tensor-parallel worker: its share of the KV
    heads, or one whole head where there are fewer KV heads than workers (vLLM replicates it)."""
    heads = max(1, config.num_kv_heads // tensor_parallel_size)
    return config.kv_bytes_per_token(dtype) // config.num_kv_heads * heads


def vllm_cache_tokens(
    config: ModelConfig, dtype: str, block_size: int, kv_cache_bytes: int, tensor_parallel_size: int
) -> int:
    """Tokens one request may hold in a vLLM KV cache of `kv_cache_bytes` per worker: whole
    pages of every layer, less the null block vLLM's pool keeps."""
    page_bytes = block_size * kv_bytes_per_token(config, dtype, tensor_parallel_size)
    return max(0, kv_cache_bytes // page_bytes - 1) * block_size


def resolve_context(config: ModelConfig, requested: int | None, cache_tokens: int) -> Context:
    """The context an engine starts with: `requested` (`--max-model-len`) when given, else the
    model's own bounded by `cache_tokens`. InvalidRequestError, in one line, for a length the
    model or the cache cannot take."""
    model_tokens = config.max_position
    if requested is not None:
        if requested < 1:
            raise InvalidRequestError(f"--max-model-len must be 1 or more, got {requested}")
        if requested > model_tokens:
            raise InvalidRequestError(
                f"--max-model-len {requested} is longer than the model's context, {model_tokens} "
                "tokens (max_position_embeddings in its config.json): give at most "
                f"{model_tokens}"
            )
        if requested > cache_tokens:
            raise InvalidRequestError(
                f"--max-model-len {requested} does not fit the KV cache, which holds "
                f"{cache_tokens} tokens of this model: raise the KV cache or give at most "
                f"{cache_tokens}"
            )
        return Context(requested, "--max-model-len", model_tokens, cache_tokens)
    if cache_tokens < 1:
        raise InvalidRequestError(
            f"the KV cache holds no whole page of this model ({cache_tokens} tokens): raise it"
        )
    if cache_tokens < model_tokens:
        return Context(cache_tokens, "kv cache", model_tokens, cache_tokens)
    return Context(model_tokens, "model", model_tokens, cache_tokens)
