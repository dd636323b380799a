"""Reference-counted pool of fixed-size KV blocks (bookkeeping only, no tensors)."""

from collections import OrderedDict
from collections.abc import Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of `block_size` tokens hold `num_tokens` (the last may be partial)."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Hands out block ids and counts their users.

    Invariant: every block is either in use (ref_count > 0) or on the free queue, never both.
    Free blocks keep their contents so the prefix index can still serve them; they are handed out
    again least recently freed first, which is the moment their cached contents are evicted.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks off the free queue (oldest first), each with ref_count 1."""
        if num > len(self._free):
            raise ValueError(f"asked for {num} blocks, {len(self._free)} free")
        block_ids = [self._free.popitem(last=False)[0] for _ in range(num)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def acquire(self, block_id: int) -> None:
        """Add a user to a block; a free (cached) block is taken off the free queue."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one user from each block; a block nobody uses joins the back of the free queue."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            assert count > 0, f"block {block_id} released more often than acquired"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
