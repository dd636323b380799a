"""Exact prefix index: full-block keys to the physical blocks that hold their KV.

Holds no tensors. A lookup matches a key AND compares the stored tokens, so a hash collision can
never serve another prefix's state.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kmesh.state.keys import BlockHash


@dataclass(frozen=True, slots=True)
class IndexedBlock:
    key: BlockHash
    # The block's own tokens, compared on every hit.
    token_ids: tuple[int, ...]
    block_id: int


class PrefixIndex:
    """Maps chained block keys to block ids. Invariant: a block id appears under at most one key."""

    def __init__(self) -> None:
        self._by_key: dict[BlockHash, IndexedBlock] = {}
        self._key_of_block: dict[int, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def match(self, keys: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Block ids of the longest run of leading blocks present with the same tokens."""
        block_ids: list[int] = []
        for key, token_ids in zip(keys, token_blocks, strict=True):
            entry = self._by_key.get(key)
            if entry is None or entry.token_ids != tuple(token_ids):
                break
            block_ids.append(entry.block_id)
        return block_ids

    def insert(self, key: BlockHash, token_ids: Sequence[int], block_id: int) -> bool:
        """Index `block_id` under `key`. Returns False (and changes nothing) when the key is
        already held by another block: the first writer stays the shared copy."""
        if key in self._by_key:
            return False
        if block_id in self._key_of_block:
            raise ValueError(f"block {block_id} is already indexed")
        self._by_key[key] = IndexedBlock(key, tuple(token_ids), block_id)
        self._key_of_block[block_id] = key
        return True

    def remove_block(self, block_id: int) -> None:
        """Forget whatever key `block_id` was indexed under (no-op when it was not indexed)."""
        key = self._key_of_block.pop(block_id, None)
        if key is not None:
            del self._by_key[key]

    def is_indexed(self, block_id: int) -> bool:
        return block_id in self._key_of_block
