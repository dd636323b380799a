"""A request's running state inside the engine."""

import enum
import time
from dataclasses import dataclass, field

import torch

from kmesh.compute.lora import LoraUse
from kmesh.engine.request import Request, RequestStats, TopLogprobs
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.state.keys import BlockHash


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Retained: all tokens computed, next-token logits held, blocks pinned; forkable.
    RETAINED = "retained"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity: a sequence is one live object
class Sequence:
    request: Request
    token_ids: list[int]
    # Tokens before the first output: the prompt (for a fork, the parent's tokens + its own).
    num_prompt: int
    status: Status = Status.WAITING
    # Physical blocks holding this sequence's KV, in token order.
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the block table (reused or computed).
    num_computed: int = 0
    # Of those, tokens restored from the external store at admission.
    num_restored: int = 0
    # Chained keys of this sequence's full blocks, as far as they have been computed.
    block_keys: list[BlockHash] = field(default_factory=list)
    # Leading blocks of block_table already offered to the prefix index.
    num_registered_blocks: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    # Per output token when params.top_logprobs > 0 (else empty).
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_logits: list[torch.Tensor] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per token of the request's own prompt, filled as
    # rows are computed (engine/prompt_logprobs.py); None when not asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Set when generation ended; a retained sequence still computes its last token after it.
    finish_reason: str | None = None
    # Next-token logits after the last token, kept while retained (forks sample from them).
    held_logits: torch.Tensor | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    # Recovery still to run on the prompt (taken by the runner at its first prefill).
    recovery: RecoveryRequest | None = None
    # Store keys of the transcript its recovery published, until the engine pins them.
    transcript: tuple[bytes, ...] = ()
    # The request's adapter and the position it applies from (None: the base model throughout).
    lora: LoraUse | None = None
    generator: torch.Generator | None = None
    submitted_at: float = field(default_factory=time.perf_counter)

    @classmethod
    def from_request(
        cls,
        request: Request,
        prefix_ids: list[int] | None = None,
        lora: LoraUse | None = None,
    ) -> "Sequence":
        """A new sequence; `prefix_ids` are a fork's parent tokens before the request's own;
        `lora` is how the request's adapter applies (None: the base model)."""
        generator = None
        if request.params is not None and request.params.seed is not None:
            generator = torch.Generator().manual_seed(request.params.seed)
        token_ids = (prefix_ids or []) + list(request.prompt_ids)
        seq = cls(
            request,
            token_ids,
            len(token_ids),
            lora=lora,
            generator=generator,
        )
        seq.stats.prompt_tokens = len(token_ids)
        if request.params is not None and request.params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(request.prompt_ids)
        return seq

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    def append(
        self, token: int, logprob: float, logits: torch.Tensor, top: TopLogprobs = ()
    ) -> None:
        self.token_ids.append(token)
        self.output_logprobs.append(logprob)
        if top:
            self.output_top_logprobs.append(top)
        if self.request.keep_logits:
            self.output_logits.append(logits)
