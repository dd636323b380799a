"""Per-request reuse's stored segments: a shared segment's KV as its first reader computed it, and
an output's KV as its author generated it, per tenant, at canonical positions.

- `placed(job)`: for each shared segment of the job's region, the stored KV placed at its
  positions: the whole segment's (FIRST_READER), or else a kept output's found inside it
  (AUTHOR: the segment wraps the output in a header; only the output's rows are placed).
- `store_computed`: a shared segment the job computed in full (nothing of it reused) is stored
  as its first reader's; `storing_end` extends a region to the end of such a segment when it
  crosses past the claim, so that it is stored whole.
- `keep_output`: a finished request's generated rows, as its tenant's output segment.

A hit compares tokens (index/segment_index.py); state never crosses tenants. Bytes are bounded by
the owner's ledger: every stored entry is held as a HeldSegment (tenant, tokens, context) and
dropped through `discard`. With `shared` (shared.py, the store's), a first
reader's segment is published there too, and one this engine lacks is read from there (and then
held here) before a job computes it. NOTE: a segment `shared` lacked is not asked for again until
the next step (`begin_step`, at each RequestRecovery.run): a step's jobs ask once per segment,
and another engine's later publish is still found from the next step on.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.config import ModelConfig
from kmesh.index.segment_index import AUTHOR, FIRST_READER, TenantIndexes
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.jobs import RecoveryJob
from kmesh.recovery.ledger import Held, HeldSegment, Ledger
from kmesh.recovery.shared import SharedSegments
from kmesh.state.segments import Role


@dataclass(frozen=True, slots=True)
class Placed:
    """Stored KV placed at prompt positions [start, start + n)."""

    start: int
    k: torch.Tensor  # [layers, n, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]


class SegmentStore:
    def __init__(
        self,
        fingerprint: str,
        config: ModelConfig,
        ledger: Ledger,
        hold: Callable[[Held, int], None],
    ) -> None:
        self.config = config
        self.ledger = ledger
        self._hold = hold  # the owner's: records bytes, drops what the bound asks
        self._index: TenantIndexes[SegmentKV] = TenantIndexes(fingerprint)
        self.shared: SharedSegments | None = None
        self._missed: set[tuple[str | None, tuple[int, ...]]] = set()  # this step's, in `shared`

    def begin_step(self) -> None:
        """A new step: segments `shared` lacked are asked for again."""
        self._missed.clear()

    def get(self, tenant: str | None, tokens: Sequence[int]) -> SegmentKV | None:
        """A segment's first-reader KV (canonical positions), held here or read from `shared`
        (then held here; not asked again this step if it lacked it), or None."""
        index = self._index(tenant)
        stored = index.get(tokens, FIRST_READER)
        if stored is not None or self.shared is None:
            return stored
        asked = (tenant, tuple(tokens))
        if asked in self._missed:
            return None
        stored = self.shared.get(tenant, tokens)
        if stored is None:
            self._missed.add(asked)
            return None
        index.put(tokens, FIRST_READER, 0, stored)
        self._hold(HeldSegment(*asked, FIRST_READER), stored.k.nbytes + stored.v.nbytes)
        return stored

    def placed(self, job: RecoveryJob) -> dict[int, Placed]:
        """Span index -> the stored KV placed at the span's positions, for shared segments of
        the region stored whole (a first reader's), or holding a kept output (its author's)."""
        placed = {}
        for i, tokens in self._shared_in_claim(job):
            found = self._stored(job.tenant, tokens)
            if found is None:
                continue
            offset, stored, held, context = found
            self.ledger.touch(HeldSegment(job.tenant, tuple(held), context))
            lo = job.spans[i].start + offset
            k, v = stored.placed(torch.arange(lo, lo + len(held)), self.config)
            placed[i] = Placed(lo, k, v)
        return placed

    def lacking(self, job: RecoveryJob) -> set[tuple[int, ...]]:
        """The tokens of the shared segments starting in the job's claim that no stored KV
        covers: what it computes and, as their first reader, stores (`storing_end`)."""
        return {
            tuple(tokens)
            for i, tokens in self._shared_in_claim(job)
            if job.spans[i].start >= job.start and self._stored(job.tenant, tokens) is None
        }

    def _shared_in_claim(self, job: RecoveryJob) -> list[tuple[int, list[int]]]:
        """(span index, tokens) of the shared segments overlapping the job's claim."""
        return [
            (i, job.token_ids[span.start : span.end])
            for i, span in enumerate(job.spans)
            if span.role is Role.SHARED and span.end > job.start and span.start < job.end
        ]

    def _stored(
        self, tenant: str | None, tokens: Sequence[int]
    ) -> tuple[int, SegmentKV, Sequence[int], str] | None:
        """What covers a shared segment: (offset in it, its KV, the tokens held, context): its
        first reader's KV whole, or else a kept output found inside it (its author's)."""
        stored = self.get(tenant, tokens)
        if stored is not None:
            return 0, stored, tokens, FIRST_READER
        found = self._index(tenant).find_within(tokens, AUTHOR)
        if found is None:
            return None
        offset, entry = found
        return offset, entry.value, list(entry.token_ids), AUTHOR

    def storing_end(self, job: RecoveryJob) -> int:
        """Where the job's region ends: the claimed rows, extended to the end of a shared
        segment that crosses past them (into the prompt's last token) and is stored nowhere yet
        (so that its first reader can store it whole; those extra tokens are computed twice)."""
        end = job.end
        for span in job.spans:
            crosses = job.start <= span.start < job.end < span.end
            tokens = job.token_ids[span.start : span.end]
            if span.role is Role.SHARED and crosses and self.get(job.tenant, tokens) is None:
                end = max(end, span.end)
        return end

    def store_computed(
        self, job: RecoveryJob, reused: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store each shared segment of the region [job.start, job.start + len(reused)) that was
        computed in full there (no row of it in `reused` [t]) and is stored nowhere yet; k, v
        [layers, t, ...] are the region's recovered rows."""
        index = self._index(job.tenant)
        end = job.start + len(reused)
        for span in job.spans:
            if span.role is not Role.SHARED or span.start < job.start or span.end > end:
                continue
            rows = slice(span.start - job.start, span.end - job.start)
            tokens = job.token_ids[span.start : span.end]
            if bool(reused[rows].any()) or index.get(tokens, FIRST_READER) is not None:
                continue
            positions = torch.arange(span.start, span.end)
            stored = SegmentKV.canonical(k[:, rows], v[:, rows], positions, self.config)
            index.put(tokens, FIRST_READER, 0, stored)
            key = HeldSegment(job.tenant, tuple(tokens), FIRST_READER)
            self._hold(key, stored.k.nbytes + stored.v.nbytes)
            if self.shared is not None:
                self.shared.put(job.tenant, tokens, stored)

    def keep_output(
        self,
        tenant: str | None,
        token_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
    ) -> None:
        """Store a request's generated tokens' KV (rows computed at positions start.., in its
        own context) as an output segment later readers under `tenant` reuse (author KV)."""
        if not token_ids:
            return
        positions = torch.arange(start, start + len(token_ids))
        stored = SegmentKV.canonical(k, v, positions, self.config)
        self._index(tenant).put(token_ids, AUTHOR, 0, stored)
        self._hold(HeldSegment(tenant, tuple(token_ids), AUTHOR), stored.k.nbytes + stored.v.nbytes)

    def discard(self, tenant: str | None, tokens: Sequence[int], context: str) -> None:
        self._index(tenant).discard(tokens, context)
