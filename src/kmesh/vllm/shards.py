"""A stored block under tensor parallelism: every worker's pages of it, in rank order.

Each of vLLM's tensor-parallel workers holds its shard of the KV heads (layout.py). Saving a block,
every worker hands its pages' bytes to the first rank over the tensor-parallel group's CPU group
(gloo: host bytes, on any device), and the first rank writes the entry; loading, each worker
copies its own part. Every worker sees the same connector metadata each step, so they gather the
same blocks in the same order. With one worker nothing is exchanged.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shards:
    rank: int  # in the tensor-parallel group
    size: int
    rank_bytes: int  # one worker's pages of a block
    group: Any = None  # torch.distributed process group (CPU); None with one worker
    first: int = 0  # the first rank's global rank

    @classmethod
    def of_engine(cls, rank_bytes: int) -> "Shards":
        """This worker's place in vLLM's tensor-parallel group."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return cls(0, 1, rank_bytes)
        return cls(
            group.rank_in_group, group.world_size, rank_bytes, group.cpu_group, group.ranks[0]
        )

    @property
    def writes(self) -> bool:
        """Whether this worker writes the stored entries."""
        return self.rank == 0

    def mine(self, entry: torch.Tensor) -> torch.Tensor:
        """This worker's part of a stored block's bytes."""
        return entry[self.rank * self.rank_bytes : (self.rank + 1) * self.rank_bytes]

    def gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's bytes of a block, in rank order, on the first rank (`mine` alone with
        one worker); an empty list on the others."""
        if self.size == 1:
            return [mine]
        parts = [torch.empty_like(mine) for _ in range(self.size)] if self.writes else None
        torch.distributed.gather(mine, parts, dst=self.first, group=self.group)
        return parts or []
