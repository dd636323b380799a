"""What a caller hands the engine, and what it gets back."""

from dataclasses import dataclass, field
from typing import Any

import torch

from kmesh.errors import InvalidRequestError
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.state.request_meta import KMeshParams

# The most top_logprobs a request may ask for (vLLM's default max_logprobs is 20).
MAX_TOP_LOGPROBS = 20
# (token id, natural-log probability), most likely first.
TopLogprobs = tuple[tuple[int, float], ...]
# Per prompt position: {token id: natural-log probability}, or None where not computed.
PromptLogprobs = tuple[dict[int, float] | None, ...]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; a seed makes sampling reproducible."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    # Keep only the k most likely tokens (0 or -1: all), and those at least min_p times as likely
    # as the most likely (0: all), as vLLM does; with temperature > 0 only.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Generation ends after any of these tokens (it is kept in the output). None: the model's
    # end-of-sequence tokens; (): never stop early.
    stop_token_ids: tuple[int, ...] | None = None
    # Generation ends once its text holds one of these (engine/stop_strings.py); it needs an
    # engine that can decode (Engine(decode=...)).
    stop: tuple[str, ...] = ()
    # vLLM's penalties (engine/sampler.py); neutral by default.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Per output token, the log-probabilities of this many most likely tokens are kept too
    # (RequestOutput.top_logprobs; the chosen token's are always kept).
    top_logprobs: int = 0
    # None: none. k: at each prompt position whose previous row this request computes, the
    # log-probabilities of the k most likely tokens and of the prompt's own token there
    # (RequestOutput.prompt_logprobs; engine/prompt_logprobs.py), as vLLM's.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be a positive number of tokens, got {self.max_tokens}"
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (all) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be None (none) or in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.prompt_logprobs}"
            )
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 is neutral), got {self.repetition_penalty}"
            )


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    # The prompt; for a fork, the branch's own tokens after the parent's state (may be empty).
    prompt_ids: tuple[int, ...]
    # None: sample nothing, only compute the prompt (valid for retained requests only).
    params: SamplingParams | None = field(default_factory=SamplingParams)
    # State is shared only between requests with the same salt (None: the shared namespace).
    tenant_salt: str | None = None
    # Fork of this retained state: start from its tokens, KV and next-token logits.
    parent_id: str | None = None
    # Keep the final state (every token computed, next-token logits held) forkable under
    # request_id, until its family ends or it is released.
    retain: bool = False
    # Return the logits each output token was sampled from (for measurements).
    keep_logits: bool = False
    # Fill the prompt's rows after its prefix hit by recovery (segments, policy, round): see
    # kmesh/recovery/requests.py. Approximate recovery needs an approximate tenant salt.
    recovery: RecoveryRequest | None = None
    # Keep the generated tokens' KV as an output segment of the tenant for later requests'
    # recovery (kmesh/recovery/requests.py); ignored under an adapter (the KV is not the base's).
    keep_output: bool = False
    # Name of a LoRA adapter loaded into the engine (None: the base model).
    adapter: str | None = None
    # The caller's `kmesh` object (kmesh serve): with a store, the family its transcript is
    # pinned for at its `next_use`, until the family ends here (`branches`, `close`).
    kmesh: KMeshParams | None = None


@dataclass(slots=True)
class RequestStats:
    # For a fork: the parent's tokens plus the branch's own.
    prompt_tokens: int = 0
    # Prompt tokens run through the model (counted again if preempted and recomputed); rows
    # filled by recovery are not (their cost is in `recovery`).
    computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache or, for a fork, from its parent.
    reused_tokens: int = 0
    # Prompt tokens whose KV was restored from the external store (kmesh store serve).
    restored_tokens: int = 0
    # Prompt tokens whose KV recovery filled (Request.recovery).
    recovered_tokens: int = 0
    # With Request.recovery: its RecoveryReport (as a dict), or {"refused": why}.
    recovery: dict[str, Any] | None = None
    # With a quality target: what served it (kmesh/recovery/quality.py).
    quality: dict[str, Any] | None = None
    # Generated tokens whose KV was kept for later readers (Request.keep_output).
    kept_output_tokens: int = 0
    output_tokens: int = 0
    # From submission to the first token, and to the end.
    first_token_seconds: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    # The model's natural-log probability of each output token (log-softmax of the raw logits,
    # before temperature or top-p).
    logprobs: tuple[float, ...]
    # With params.top_logprobs k > 0: the k most likely tokens at each output token.
    top_logprobs: tuple[TopLogprobs, ...]
    # "stop" (a stop token), "length" (max_tokens or the model's context), or "retained" (a
    # retained request that sampled nothing).
    finish_reason: str
    stats: RequestStats
    # With keep_logits: the float32 logits [vocab] each output token was sampled from.
    logits: tuple[torch.Tensor, ...] | None = None
    # With params.prompt_logprobs k: one entry per token of Request.prompt_ids (for a fork, the
    # branch's own tokens, after the parent's), the distribution of that token given all before
    # it: the k most likely tokens' log-probabilities and the token's own. None where this
    # request did not compute the row before: position 0 (a fork's first token has its
    # parent's held logits), prefix hits, restored or recovered rows (engine/prompt_logprobs.py).
    prompt_logprobs: PromptLogprobs | None = None
