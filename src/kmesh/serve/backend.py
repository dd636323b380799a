"""What the HTTP layer needs from an engine: one generation job in, token deltas out.

Both engines implement `Backend`; the app tokenizes, checks and decodes, so they only generate.
"""

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from kmesh.engine.request import TopLogprobs
from kmesh.state.request_meta import KMeshParams
from kmesh.stats import EngineLoad


@dataclass(frozen=True, slots=True)
class GenerationJob:
    prompt_ids: tuple[int, ...]
    # At least 1, and no more than the model's context leaves after the prompt.
    max_tokens: int
    # 0 is greedy.
    temperature: float
    top_p: float
    seed: int | None
    # The caller's `kmesh` object (family, segments), if it sent one.
    kmesh: KMeshParams | None
    # The tenant: state is never shared across salts (None: the shared namespace).
    cache_salt: str | None
    # Stop strings: the engine ends generation once its text holds one (the app cuts the text
    # there: kmesh/engine/stop_strings.py).
    stop: tuple[str, ...] = ()
    # vLLM's sampling penalties (kmesh/engine/sampler.py), neutral by default.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: no log-probabilities; k: each output token's, and the k most likely tokens' there.
    logprobs: int | None = None
    # vLLM's: keep the k most likely (0: all), drop those under min_p times the most likely.
    top_k: int = 0
    min_p: float = 0.0
    # Generate max_tokens whatever the model says (end-of-sequence tokens do not stop it).
    ignore_eos: bool = False

    def sampling(self) -> dict[str, Any]:
        """The sampling fields both engines' SamplingParams take under these names (stop
        strings and ignore_eos aside: each engine takes them in its own way)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's natural-log probability under the model (before penalties,
    temperature and top-p), and the job's `logprobs` most likely tokens there."""

    logprob: float
    top: TopLogprobs


@dataclass(frozen=True, slots=True)
class Delta:
    # Tokens generated since the previous delta (may be empty).
    token_ids: tuple[int, ...]
    # None until the last delta: then "stop" (an end-of-sequence token) or "length".
    finish_reason: str | None = None
    # On the last delta: prompt_tokens, computed_tokens, reused_tokens (local prefix cache),
    # restored_tokens (external store), and whatever else the engine reports.
    stats: dict[str, Any] | None = None
    # With job.logprobs: one per token of token_ids.
    logprobs: tuple[TokenLogprob, ...] = ()


class EngineStoppedError(RuntimeError):
    """The engine stopped serving after an unexpected error (a bug, out of memory): every request
    fails until the server is restarted (HTTP 503)."""


class Backend(Protocol):
    # "reference" or "vllm".
    engine: str
    # The id clients name in `model` (the model folder's name).
    model_id: str
    # The model's transformers tokenizer (prompts are tokenized by the app, not the engine).
    tokenizer: Any
    # Prompt plus generated tokens at most.
    max_model_len: int
    # Token ids the model takes: [0, vocab_size) (its embedding's rows).
    vocab_size: int

    async def start(self) -> None:
        """Start the engine (called once, inside the server's event loop)."""

    async def close(self) -> None:
        """Stop the engine and release what it holds."""

    def failure(self) -> str | None:
        """Why the engine stopped serving (it failed; a restart is needed), or None."""
        ...

    def load(self) -> EngineLoad:
        """The engine's latest load (updated as it steps)."""
        ...

    def generate(self, job: GenerationJob) -> AsyncGenerator[Delta, None]:
        """Deltas of one job, the last with finish_reason and stats. Raises a KMeshError for a
        job the engine refuses (the caller's mistake)."""
        ...

    def branches(self, job: GenerationJob, n: int) -> AsyncGenerator[tuple[int, Delta], None]:
        """(branch index, delta) of the job's `n` choices as they come (seeds job.seed + i),
        the prompt's work shared between them (kmesh/serve/branches.py)."""
        ...
