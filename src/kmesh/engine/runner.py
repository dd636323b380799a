"""Run one scheduled batch through the executor over the paged KV cache."""

import logging
from collections.abc import Sequence as Sequence_
from dataclasses import asdict

import torch

from kmesh.compute.executor import Executor, SequenceInput
from kmesh.engine.prompt_logprobs import collect
from kmesh.engine.scheduler import ScheduledBatch
from kmesh.engine.sequence import Sequence
from kmesh.kv.kv_cache import PagedContext, PagedKVCache
from kmesh.recovery.jobs import RecoveredRows, RecoveryJob
from kmesh.recovery.requests import DEFAULT_RECOVERY_BYTES, RequestRecovery
from kmesh.recovery.shared import SharedState

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        executor: Executor,
        cache: PagedKVCache,
        fingerprint: str,
        recovery_bytes: int = DEFAULT_RECOVERY_BYTES,
        shared: SharedState | None = None,
    ) -> None:
        self.executor = executor
        self.cache = cache
        self.recovery = RequestRecovery(
            executor, fingerprint, recovery_bytes, cache.block_size, shared
        )

    def step(self, batch: ScheduledBatch) -> torch.Tensor:
        """Do the batch's block copies, fill the rows recovery claims, compute every sequence's
        pending tokens, store their KV, and collect the prompt log-probabilities of the
        sequences that ask for them (their other rows' logits, only then).

        Returns the next-token logits after each sequence's last token, [len(batch.seqs), vocab].
        """
        for source, destination in batch.copies:
            self.cache.copy_block(source, destination)
        self._recover([seq for seq in batch.seqs if seq.recovery is not None])
        shared = self._shared_prefixes(batch.seqs)
        inputs = []
        slots = []
        starts = []
        for seq in batch.seqs:
            start, end = seq.num_computed, len(seq.token_ids)
            starts.append(start)
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
                    seq.lora,
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
        for seq, start, out in zip(batch.seqs, starts, outputs, strict=True):
            seq.num_computed = len(seq.token_ids)
            collect(seq, start, out.hidden, self.executor.logits)
        return self.executor.logits(torch.stack([out.hidden[-1] for out in outputs]))

    def _recover(self, seqs: list[Sequence]) -> None:
        """Recovery claims every prompt row after the prefix hit but the last (which the step
        then computes, giving the logits, as vLLM does); rows the gate left alone, and every
        claimed row when recovery raises (logged), are computed by the step."""
        claims = []
        for seq in seqs:
            wanted, seq.recovery = seq.recovery, None
            assert wanted is not None
            if seq.num_computed >= seq.num_prompt - 1:
                continue
            claims.append(
                (
                    seq,
                    RecoveryJob(
                        seq.request.request_id,
                        seq.token_ids[: seq.num_prompt],
                        list(seq.block_table),
                        seq.num_computed,
                        seq.num_prompt - 1,
                        seq.request.tenant_salt,
                        list(wanted.spans),
                        wanted.spec,
                        wanted.family,
                    ),
                )
            )
        if not claims:
            return
        by_id = {job.request_id: seq for seq, job in claims}

        def write(job: RecoveryJob, outcome: RecoveredRows) -> None:
            seq = by_id[job.request_id]
            seq.stats.recovery = asdict(outcome.report)
            if outcome.k is None or outcome.v is None:
                return
            slots = self.cache.slots(seq.block_table, job.start, job.end)
            for layer in range(self.executor.config.num_layers):
                self.cache.write(layer, slots, outcome.k[layer], outcome.v[layer])
            seq.num_computed = job.end
            seq.stats.computed_tokens -= job.end - job.start
            seq.stats.recovered_tokens = job.end - job.start

        try:
            outcomes = self.recovery.run([job for _, job in claims], _CacheRows(self.cache), write)
        except Exception as error:  # recovery must never take the engine down: the step computes
            log.warning(
                "kmesh: recovery failed, the step computes the claimed tokens: %s",
                error,
                exc_info=True,
            )
            for seq, job in claims:  # as vLLM's worker does: every claimed row computed anew
                if seq.num_computed == job.end:  # written before the failure
                    seq.stats.computed_tokens += job.end - job.start
                seq.num_computed = job.start
                seq.stats.recovered_tokens = 0
                seq.stats.recovery = None
            return
        for request_id, outcome in outcomes.items():
            by_id[request_id].transcript = outcome.transcript

    def keep_output(self, seq: Sequence) -> int:
        """Hand the finished sequence's generated rows (every output token fed back) to
        recovery as its output segment; how many."""
        start, end = seq.num_prompt, seq.num_computed
        if end <= start:
            return 0
        k, v = _CacheRows(self.cache).read(seq.block_table, torch.arange(start, end))
        self.recovery.segments.keep_output(
            seq.request.tenant_salt, seq.token_ids[start:end], k, v, start
        )
        return end - start

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


class _CacheRows:
    """The paged cache as recovery's PrefixReader."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def read(
        self, block_ids: Sequence_[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.cache.block_size
        slots = torch.tensor(block_ids, dtype=torch.long)[positions // bs] * bs + positions % bs
        return self.cache.k[:, slots], self.cache.v[:, slots]
