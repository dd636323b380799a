"""Where a recovery job starts, and what it leaves for later jobs: the bookkeeping around
requests.py's recovery of a step's jobs.

- `continued`: a job whose prefix a kept tail (prefix_tails.py) continues starts after it; a job
  with segments first restores the rows of its transcript shared state holds past its start
  (shared.py::SharedTranscripts; published by an earlier job of any engine: the same rows, bit
  for bit), and, reaching further than the tail, starts after those. A kept tail reaching as
  far wins (no read): a member's tail and its piece are the same rows, both kept from the job
  that recovered them. The rows it starts after are handed to the step's TailPages, which then
  serve them as prefix.
- `finish`: the outcome over the job's whole claim (those rows first), reported as tail or
  restored rows, and the job's own tails kept (held in the ledger).
- `write`: the outcome handed to the engine, then the job's transcript's new rows published
  (its mirrors of the round's master where they give those rows back); what is reported back
  holds no rows, so that the memory of a step's batch is free for the next.

What a step restored is filed by request id in a dict the caller keeps for the step (`Restored`:
the chain to publish after, its rows, the bytes read).
"""

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from kmesh.recovery.jobs import PrefixReader, RecoveredRows, RecoveryJob, Writer
from kmesh.recovery.ledger import Held, HeldTail, Ledger
from kmesh.recovery.prefix_tails import PrefixTails, TailPages
from kmesh.recovery.shared import Restored, SharedTranscripts


class Continuations:
    """Kept tails and shared transcripts of one engine's recovery (see the module docstring)."""

    def __init__(
        self, ledger: Ledger, hold: Callable[[Held, int], None], tails: PrefixTails | None
    ) -> None:
        """`hold(key, nbytes)` keeps a tail within the ledger's bound (RequestRecovery's);
        `tails` None keeps none."""
        self.ledger = ledger
        self._hold = hold
        self.tails = tails
        self.transcripts: SharedTranscripts | None = None

    def continued(
        self, job: RecoveryJob, tails: TailPages, restored: dict[str, Restored]
    ) -> RecoveryJob:
        """The job after the kept tail its prefix continues or, reaching further, its
        transcript's rows restored from shared state (filed in `restored`), those rows handed to
        `tails` (which then serves them as prefix); the job itself without either."""
        found = None if self.tails is None else self.tails.find(job)
        if self.transcripts is not None and job.spans:
            have = job.start if found is None else found[0]
            got = restored[job.request_id] = self.transcripts.restore(job, have)
            if got.k is not None and got.v is not None and got.chain.end > have:
                tails.add(job, (got.k, got.v))
                return replace(job, start=got.chain.end)
        if found is None:
            return job
        end, rows = found
        self.ledger.touch(HeldTail(job.tenant, tuple(job.token_ids[:end])))
        tails.add(job, rows)
        return replace(job, start=end)

    def finish(
        self,
        job: RecoveryJob,
        outcome: RecoveredRows,
        tails: TailPages,
        restored: dict[str, Restored],
    ) -> RecoveredRows:
        """The outcome over the job's whole claim (restored or tail rows first), its tails
        kept."""
        tail = tails.of(job)
        if tail is not None:
            n = tail[0].shape[1]
            got = restored.get(job.request_id)
            if got is not None and got.k is tail[0]:
                report = replace(outcome.report, restored_tokens=n, restored_bytes=got.nbytes)
            else:
                report = replace(outcome.report, tail_tokens=n)
            if outcome.k is None or outcome.v is None:
                return RecoveredRows(report, None, None)
            k = torch.cat((tail[0], outcome.k), dim=1)
            v = torch.cat((tail[1], outcome.v), dim=1)
            outcome = RecoveredRows(report, k, v, outcome.mirrors)
        if self.tails is not None and outcome.k is not None and outcome.v is not None:
            for prefix, nbytes in self.tails.keep(job, outcome.k, outcome.v):
                self._hold(HeldTail(job.tenant, prefix), nbytes)
        return outcome

    def write(
        self,
        job: RecoveryJob,
        outcome: RecoveredRows,
        pages: PrefixReader,
        write: Writer,
        restored: dict[str, Restored],
    ) -> RecoveredRows:
        """Hand the outcome to the engine, then publish the job's transcript (the rows it
        wrote read from the outcome, any before them from its pages); the outcome without its
        rows (the engine has them: a step's later batches reuse their memory), with the keys of
        its transcript's entries."""
        write(job, outcome)
        got = restored.get(job.request_id)
        keys: tuple[bytes, ...] = ()
        if self.transcripts is not None and got is not None and outcome.k is not None:
            written = _Written(pages, job, outcome)
            keys = self.transcripts.publish(job, got.chain, written, outcome.mirrors)
        return replace(outcome, k=None, v=None, transcript=keys)

    def discard(self, held: HeldTail) -> None:
        """Forget a tail the ledger dropped."""
        if self.tails is not None:
            self.tails.discard(held.tenant, held.prefix)


class _Written:
    """A job's pages after `write`: the rows it wrote served from its outcome (views: the same
    bits, since the engine's cache holds the executor's dtype), any other from the pages."""

    def __init__(self, pages: PrefixReader, job: RecoveryJob, outcome: RecoveredRows) -> None:
        self.pages, self.job, self.outcome = pages, job, outcome

    def read(
        self, block_ids: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        job, k, v = self.job, self.outcome.k, self.outcome.v
        n = positions.numel()
        lo = int(positions[0]) if n else job.start
        if (
            k is None
            or v is None
            or list(block_ids) != list(job.block_ids)
            or not job.start <= lo <= lo + n <= job.end
            or not bool((positions == torch.arange(lo, lo + n)).all())
        ):
            return self.pages.read(block_ids, positions)
        rows = slice(lo - job.start, lo - job.start + n)
        return k[:, rows], v[:, rows]
