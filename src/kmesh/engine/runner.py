"""Run one scheduled batch through the executor over the paged KV cache."""

import torch

from kmesh.compute.executor import Executor, SequenceInput
from kmesh.engine.scheduler import ScheduledBatch
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
        inputs = []
        slots = []
        for seq in batch.seqs:
            start, end = seq.num_computed, len(seq.token_ids)
            context = PagedContext(self.cache, seq.block_table, start) if start else None
            inputs.append(
                SequenceInput(
                    torch.tensor(seq.token_ids[start:end]), torch.arange(start, end), context
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
