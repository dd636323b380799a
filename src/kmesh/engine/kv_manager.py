"""Block tables for sequences: allocation, exact prefix reuse, registration and release.

Wires the ref-counted BlockPool to the PrefixIndex; the scheduler only sees yes/no answers and
the number of reused tokens.
"""

from kmesh.engine.sequence import Sequence
from kmesh.index.prefix_index import PrefixIndex
from kmesh.kv.block_pool import BlockPool
from kmesh.state.keys import KeyNamespace, block_key


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, model_fingerprint: str) -> None:
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(num_blocks)
        self.index = PrefixIndex()

    def _namespace(self, seq: Sequence) -> KeyNamespace:
        return KeyNamespace(model=self.model_fingerprint, tenant_salt=seq.request.tenant_salt)

    def _extend_keys(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        namespace = self._namespace(seq)
        while len(seq.block_keys) < num_full_blocks:
            start = len(seq.block_keys) * bs
            parent = seq.block_keys[-1] if seq.block_keys else None
            seq.block_keys.append(block_key(namespace, parent, seq.token_ids[start : start + bs]))

    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence its block table, reusing cached full blocks of its prefix.

        Returns False (changing nothing) when the pool cannot hold it now.
        NOTE: the last token is always computed (its logits are needed), so the match stops at
        the last full block before it.
        """
        bs = self.block_size
        num_tokens = len(seq.token_ids)
        max_hit_blocks = (num_tokens - 1) // bs
        self._extend_keys(seq, max_hit_blocks)
        hit_ids = self.index.match(
            seq.block_keys[:max_hit_blocks],
            [seq.token_ids[i * bs : (i + 1) * bs] for i in range(max_hit_blocks)],
        )
        num_new = blocks_for(num_tokens, bs) - len(hit_ids)
        hits_on_free_queue = sum(1 for b in hit_ids if self.pool.ref_count(b) == 0)
        if self.pool.num_free < num_new + hits_on_free_queue:
            return False
        for block_id in hit_ids:
            self.pool.acquire(block_id)
        seq.block_table = hit_ids + self._allocate(num_new)
        seq.num_computed = len(hit_ids) * bs
        seq.num_registered_blocks = len(hit_ids)
        return True

    def ensure_slot(self, seq: Sequence) -> bool:
        """Make room for the sequence's next token; False when no block is free."""
        if len(seq.token_ids) <= len(seq.block_table) * self.block_size:
            return True
        if self.pool.num_free == 0:
            return False
        seq.block_table += self._allocate(1)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix index."""
        num_full = seq.num_computed // self.block_size
        self._extend_keys(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            self.index.insert(
                seq.block_keys[i], seq.token_ids[i * bs : (i + 1) * bs], seq.block_table[i]
            )
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones stay reusable until evicted.

        Released tail first, so a shared prefix outlives the private tails behind it.
        """
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered_blocks = 0

    def _allocate(self, num: int) -> list[int]:
        block_ids = self.pool.allocate(num)
        for block_id in block_ids:
            self.index.remove_block(block_id)  # evict whatever the block cached before
        return block_ids
