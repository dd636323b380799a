"""Which sequences run in the next step.

Every step runs all running sequences' pending tokens (decode) plus as many waiting sequences as
fit (prefill), in one batch, in arrival order; a sequence whose next blocks another engine is
computing (the store) is passed over until they are published, and the rest go ahead. When a
running sequence finds no free block, the most recently admitted sequence is preempted: its
blocks are released and it waits again, to be recomputed (its cached blocks usually still hit
when it comes back). Retained sequences are not scheduled and cannot be preempted: their blocks
stay pinned until released.
"""

from collections import deque
from dataclasses import dataclass, field

from kmesh.engine.kv_manager import Admission, KVCacheManager
from kmesh.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    # Copy-on-write block copies (source, destination) to do before computing.
    copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_tokens: int, max_seqs: int) -> None:
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Waiting sequences the last schedule() left for another engine's blocks.
        self.num_store_waits = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence: a new one, or a fork that already holds its parent's blocks."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        """The running or waiting sequence of a request, if any."""
        for seq in (*self.running, *self.waiting):
            if seq.request.request_id == request_id:
                return seq
        return None

    def schedule(self) -> ScheduledBatch:
        """Sequences to run now; each computes its tokens from num_computed to the end."""
        batch = ScheduledBatch()
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below, while making room for an earlier sequence
            while (copies := self.kv.reserve(seq)) is None:
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            else:
                batch.seqs.append(seq)
                batch.copies += copies
        budget = self.max_batch_tokens - len(batch.seqs)
        self.num_store_waits = 0
        for seq in list(self.waiting):
            if len(self.running) >= self.max_seqs:
                break
            needed = len(seq.token_ids) - seq.num_computed  # upper bound before prefix hits
            if batch.seqs and needed > budget:
                break
            if seq.block_table:  # a fork: it holds its parent's blocks already
                copies = self.kv.reserve(seq)
                if copies is None:
                    break
                batch.copies += copies
            else:
                admission = self.kv.admit(seq)
                if admission is Admission.WAIT:  # the rest may go ahead of it
                    self.num_store_waits += 1
                    continue
                if admission is Admission.NO_ROOM:
                    break
            self.waiting.remove(seq)
            # After a preemption this counts again what is recomputed or reused.
            seq.stats.restored_tokens += seq.num_restored
            seq.stats.reused_tokens += min(seq.num_computed, seq.num_prompt) - seq.num_restored
            seq.stats.computed_tokens += max(0, seq.num_prompt - seq.num_computed)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            budget -= needed
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.kv.free(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a running or waiting sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.kv.free(seq)

    def retain(self, seq: Sequence) -> None:
        """Stop scheduling a sequence but keep its blocks (pinned) for forks."""
        seq.status = Status.RETAINED
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.kv.free(seq)
        self.waiting.appendleft(seq)
