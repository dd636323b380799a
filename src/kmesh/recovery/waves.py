"""A step's per-request recovery jobs in waves: the jobs of one wave are recovered in one executor
batch (requests.py), one wave after the other, each wave chosen once the one before it is done.

A job waits for a later wave when it depends on a job before it in the step that has not run yet:
- it lacks a shared segment that job lacks too: that job computes it and stores it as its first
  reader (segment_store.py), and the waiting job then reuses it, as one at a time it would;
- its prefix (its rows before its start) lies in a page that job fills: an engine's prefix cache
  may hand a request pages filled in the same step;
- or its recovery settings differ from the wave's (one batch, one config);
and a wave holds at most `max_rows` claimed rows (one job may hold more alone): the executor's
working memory grows with its batch.
Jobs keep their order within and across waves. What one-at-a-time recovery would have given a
job, a wave gives it too, except the page tails (prefix_tails.py) kept by jobs of its own wave:
it computes those rows instead (exact either way). Without a page size every wave is one job.

Invariants: every job is in exactly one wave; the first pending job always starts the next wave.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kmesh.kv.block_pool import blocks_for
from kmesh.recovery.jobs import RecoveryJob

Tokens = tuple[int, ...]


def waves(
    jobs: Sequence[RecoveryJob],
    lacking: Callable[[RecoveryJob], set[Tokens]],
    config_of: Callable[[RecoveryJob], Any],
    page_size: int | None,
    max_rows: int,
) -> Iterator[list[RecoveryJob]]:
    """The jobs in waves (see the module docstring). `lacking(job)`: the tokens of the shared
    segments in its claim no stored KV covers, asked when its wave is chosen; `config_of(job)`:
    its recovery settings, compared by equality."""
    pending = list(jobs)
    while pending:
        if page_size is None:
            yield [pending.pop(0)]
            continue
        wave: list[RecoveryJob] = []
        later: list[RecoveryJob] = []
        lacked: set[Tokens] = set()  # by the jobs seen so far, in the wave or not
        filled: set[int] = set()  # pages the jobs seen so far fill
        config = config_of(pending[0])
        rows = 0
        for job in pending:
            lack = lacking(job)
            prefix = set(job.block_ids[: blocks_for(job.start, page_size)])
            fits = not wave or rows + job.end - job.start <= max_rows
            if fits and config_of(job) == config and not lack & lacked and not prefix & filled:
                wave.append(job)
                rows += job.end - job.start
            else:
                later.append(job)
            lacked |= lack
            filled.update(job.block_ids[job.start // page_size : blocks_for(job.end, page_size)])
        yield wave
        pending = later
