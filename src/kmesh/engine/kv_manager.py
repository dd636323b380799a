"""Block tables for sequences: allocation, exact prefix reuse, registration and release.

Wires the ref-counted BlockPool to the PrefixIndex; the scheduler only sees whether a sequence
was admitted (or why not) and the number of reused tokens.
"""

import enum

from kmesh.engine.block_store import BlockStore
from kmesh.engine.sequence import Sequence
from kmesh.index.prefix_index import PrefixIndex
from kmesh.kv.block_pool import BlockPool, blocks_for
from kmesh.state.keys import KeyNamespace, activated_adapter, extend_adapter_block_keys


class Admission(enum.Enum):
    ADMITTED = "admitted"
    NO_ROOM = "no room"  # the pool cannot hold it now
    WAIT = "wait"  # another engine computes its next block: ask again at a later step


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str,
        prefix_caching: bool,
        store: BlockStore | None = None,
    ) -> None:
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        # Off: no block is matched or registered across sequences (forks still share).
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks)
        self.index = PrefixIndex()
        # External restoration: blocks the local index misses come from the store if it has them.
        self.store = store

    def _namespace(self, seq: Sequence, adapted: bool) -> KeyNamespace:
        adapter = None
        if adapted and seq.lora is not None:
            adapter = seq.lora.adapter.key
            if seq.lora.adapter.activated:
                adapter = activated_adapter(adapter, seq.lora.start)
        return KeyNamespace(self.model_fingerprint, adapter, seq.request.tenant_salt)

    def extend_keys(self, seq: Sequence, num_full_blocks: int) -> None:
        """Compute the chained keys of the sequence's first `num_full_blocks` full blocks.

        Blocks wholly before the position the sequence's adapter applies from hold base-model
        state and are keyed as the base model's (an activated adapter's context is shared with
        every request of the base model and of other activated adapters); the rest are keyed
        with the adapter and, for an activated one, that position (the same tokens with the
        adapter starting elsewhere are other state)."""
        if len(seq.block_keys) >= num_full_blocks:
            return
        tokens = seq.token_ids[: num_full_blocks * self.block_size]
        start = len(tokens) if seq.lora is None else seq.lora.start
        base, adapted = self._namespace(seq, False), self._namespace(seq, True)
        extend_adapter_block_keys(seq.block_keys, base, adapted, tokens, self.block_size, start)

    def admit(self, seq: Sequence) -> Admission:
        """Give a waiting sequence its block table, reusing cached full blocks of its prefix and
        restoring what the store holds after them. Changes nothing unless ADMITTED.
        NOTE: the last token is always computed (its logits are needed), so the match stops at
        the last full block before it.
        """
        bs = self.block_size
        num_tokens = len(seq.token_ids)
        max_hit_blocks = (num_tokens - 1) // bs if self.prefix_caching else 0
        self.extend_keys(seq, max_hit_blocks)
        hit_ids = self.index.match(
            seq.block_keys[:max_hit_blocks],
            [seq.token_ids[i * bs : (i + 1) * bs] for i in range(max_hit_blocks)],
        )
        num_new = blocks_for(num_tokens, bs) - len(hit_ids)
        hits_on_free_queue = sum(1 for b in hit_ids if self.pool.ref_count(b) == 0)
        if self.pool.num_free < num_new + hits_on_free_queue:
            return Admission.NO_ROOM
        got = None
        if self.store is not None:
            got = self.store.lookup(seq, len(hit_ids), max_hit_blocks)
            if got is None:
                return Admission.WAIT
        for block_id in hit_ids:
            self.pool.acquire(block_id)
        seq.block_table = hit_ids + self._allocate(num_new)
        restored = 0
        if self.store is not None and got is not None:
            restored = self.store.restore(seq, len(hit_ids), got)
        seq.num_computed = (len(hit_ids) + restored) * bs
        seq.num_restored = restored * bs
        seq.num_registered_blocks = len(hit_ids)
        return Admission.ADMITTED

    def reserve(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Make room for the sequence's pending tokens: copy-on-write its partly filled last block
        if another sequence shares it, and allocate blocks up to its length.

        Returns the (source, destination) block copies the runner must do before computing, or
        None (changing nothing) when too few blocks are free.
        NOTE: only the block holding position num_computed can be both shared and written: full
        blocks are never written again, and blocks past it are this sequence's own.
        """
        bs = self.block_size
        write_block = seq.num_computed // bs
        shared = (
            seq.num_computed % bs != 0 and self.pool.ref_count(seq.block_table[write_block]) > 1
        )
        num_new = blocks_for(len(seq.token_ids), bs) - len(seq.block_table)
        if self.pool.num_free < num_new + int(shared):
            return None
        copies = []
        if shared:
            [own] = self._allocate(1)
            copies.append((seq.block_table[write_block], own))
            self.pool.release([seq.block_table[write_block]])
            seq.block_table[write_block] = own
        if num_new > 0:
            seq.block_table += self._allocate(num_new)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's computed state by reference: its blocks, one user more."""
        for block_id in parent.block_table:
            self.pool.acquire(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        child.block_keys = list(parent.block_keys)
        child.num_registered_blocks = parent.num_registered_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix index."""
        if not self.prefix_caching:
            return
        num_full = seq.num_computed // self.block_size
        self.extend_keys(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            self.index.insert(
                seq.block_keys[i], seq.token_ids[i * bs : (i + 1) * bs], seq.block_table[i]
            )
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        if self.store is not None:
            self.store.publish(seq, num_full)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones stay reusable until evicted.

        Released tail first, so a shared prefix outlives the private tails behind it.
        """
        if self.store is not None:
            self.store.release(seq)
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed = 0
        seq.num_restored = 0
        seq.num_registered_blocks = 0

    def _allocate(self, num: int) -> list[int]:
        block_ids = self.pool.allocate(num)
        for block_id in block_ids:
            self.index.remove_block(block_id)  # evict whatever the block cached before
        return block_ids
