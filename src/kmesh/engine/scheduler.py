"""Which sequences run in the next step.

Every step runs all running sequences' next token (decode) plus as many waiting prompts as fit
(prefill), in one batch. When a decode finds no free block, the most recently admitted sequence
is preempted: its blocks are released and it waits again, to be recomputed (its cached blocks
usually still hit when it comes back).
"""

from collections import deque

from kmesh.engine.kv_manager import KVCacheManager
from kmesh.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_tokens: int, max_seqs: int) -> None:
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Sequences to run now; each computes its tokens from num_computed to the end."""
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below, while making room for an earlier sequence
            while not self.kv.ensure_slot(seq):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            else:
                batch.append(seq)
        budget = self.max_batch_tokens - len(batch)
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            needed = len(seq.token_ids)  # upper bound: prefix hits only lower it
            if batch and needed > budget:
                break
            if not self.kv.admit(seq):
                break
            self.waiting.popleft()
            # After a preemption this counts again what is recomputed or reused.
            seq.stats.reused_tokens += seq.num_computed
            seq.stats.computed_tokens += len(seq.token_ids) - seq.num_computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(seq)
            budget -= needed
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.kv.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.kv.free(seq)
        self.waiting.appendleft(seq)
