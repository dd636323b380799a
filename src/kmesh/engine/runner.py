"""Run one scheduled batch through the executor over the paged KV cache."""

import torch

from kmesh.compute.executor import Executor, SequenceInput
from kmesh.engine.scheduler import ScheduledBatch
from kmesh.engine.sequence import Sequence
from kmesh.kv.kv_cache import PagedContext, PagedKVCache


class ModelRunner:
    def __init__(self, executor: Executor, cache: PagedKVCache) -> None:
        self.executor = executor
        self.cache = cache

    def step(self, batch: ScheduledBatch) -> torch.Tensor:
        """Do the batch's block copies, compute every sequence's pending tokens, store their KV.

        Returns the next-token logits after each sequence's last token, [len(batch.seqs), vocab].
        """
        for source, destination in batch.copies:
            self.cache.copy_block(source, destination)
        shared = self._shared_prefixes(batch.seqs)
        inputs = []
        slots = []
        for seq in batch.seqs:
            start, end = seq.num_computed, len(seq.token_ids)
            prefix, num_shared = shared.get(id(seq), (None, 0))
            context = None
            if start > num_shared:
                context = PagedContext(self.cache, seq.block_table, num_shared, start)
            inputs.append(
                SequenceInput(
                    torch.tensor(seq.token_ids[start:end]),
                    torch.arange(start, end),
                    context,
                    prefix,
                )
            )
            slots.append(self.cache.slots(seq.block_table, start, end))
        outputs = self.executor.forward(inputs)
        all_slots = torch.cat(slots)
        for layer in range(self.executor.config.num_layers):
            self.cache.write(
                layer,
                all_slots,
                torch.cat([out.k[layer] for out in outputs]),
                torch.cat([out.v[layer] for out in outputs]),
            )
        for seq in batch.seqs:
            seq.num_computed = len(seq.token_ids)
        return self.executor.logits(torch.stack([out.hidden[-1] for out in outputs]))

    def _shared_prefixes(self, seqs: list[Sequence]) -> dict[int, tuple[PagedContext, int]]:
        """For sequences that hold the same physical leading blocks (forks of one trunk, prefix
        cache hits on one prefix): one context over those blocks, and its length in tokens."""
        bs = self.cache.block_size
        by_first_block: dict[int, list[Sequence]] = {}
        for seq in seqs:
            if seq.num_computed >= bs:
                by_first_block.setdefault(seq.block_table[0], []).append(seq)
        shared = {}
        for group in by_first_block.values():
            if len(group) < 2:
                continue
            num_blocks = min(seq.num_computed // bs for seq in group)
            for i in range(num_blocks):
                if any(seq.block_table[i] != group[0].block_table[i] for seq in group):
                    num_blocks = i
                    break
            prefix = PagedContext(self.cache, group[0].block_table, 0, num_blocks * bs)
            for seq in group:
                shared[id(seq)] = (prefix, num_blocks * bs)
        return shared
