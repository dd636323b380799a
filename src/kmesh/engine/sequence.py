"""A request's running state inside the engine."""

import enum
import time
from dataclasses import dataclass, field

import torch

from kmesh.engine.request import Request, RequestStats
from kmesh.state.keys import BlockHash


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request: Request
    token_ids: list[int]
    status: Status = Status.WAITING
    # Physical blocks holding this sequence's KV, in token order.
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the block table (reused or computed).
    num_computed: int = 0
    # Chained keys of this sequence's full blocks, as far as they have been computed.
    block_keys: list[BlockHash] = field(default_factory=list)
    # Leading blocks of block_table already offered to the prefix index.
    num_registered_blocks: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    generator: torch.Generator | None = None
    submitted_at: float = field(default_factory=time.perf_counter)

    @classmethod
    def from_request(cls, request: Request) -> "Sequence":
        generator = None
        if request.params.seed is not None:
            generator = torch.Generator().manual_seed(request.params.seed)
        seq = cls(request=request, token_ids=list(request.prompt_ids), generator=generator)
        seq.stats.prompt_tokens = len(request.prompt_ids)
        return seq

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]
