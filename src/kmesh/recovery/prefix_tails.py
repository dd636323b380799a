"""Continuations of a prefix at token granularity: the rows past an engine's last whole page.

An engine's prefix cache hits whole pages, so a prompt that shares more with an earlier one than
its whole pages hold (a sibling's trunk ending inside a page; a sibling's previous prompt minus its
instruction, which its next prompt continues) has the shared rows of that partial page computed
again. A recovering request keeps those rows at the boundaries of its prompt (`boundaries`): the
end of its leading shared segments (its family's trunk) and the start of its closing (its last
segment, and a chat's last message before the generation prompt: where the next prompt of a
transcript continues). Each kept tail is the rows [a, b) from the boundary's
page start a to the boundary b (less than a page), keyed by every token before b in the tenant's
namespace (SHA-256; a hit compares tokens). A later request whose claim starts at a takes the
longest kept tail its own tokens continue as it is: the same tokens at the same positions after
the same prefix, i.e. the rows the earlier request held there (exact where its were).
`TailPages` serves a job's prefix from the engine's pages and the tail that continues it.

Invariants: a tail never crosses tenants; a tail is used only when its every token before b equals
the request's; rows are kept only from a region that was written (not one the gate gave back).
"""

from collections.abc import Sequence

import torch

from kmesh.index.segment_index import TenantIndexes
from kmesh.recovery.jobs import PrefixReader, RecoveryJob
from kmesh.state.segments import Role, trunk_end

TAIL = "prefix-tail"

Rows = tuple[torch.Tensor, torch.Tensor]  # k, v [layers, n, kv_heads, head_dim]


def boundaries(job: RecoveryJob) -> list[int]:
    """The prompt positions after which `job`'s prompt is likely continued by another: its
    trunk's end and its last segment's start; when that segment is an instruction right after a
    segment of the caller's own (a chat's generation prompt after its last message), that
    segment's start too, since a next prompt may drop the last message (a round's ask) or keep
    it (a tool's result)."""
    spans = job.spans
    if not spans:
        return []
    ends = {trunk_end(spans), spans[-1].start}
    if len(spans) > 1 and spans[-1].role is Role.INSTRUCTION and spans[-2].role is Role.PRIVATE:
        ends.add(spans[-2].start)
    return sorted(b for b in ends if b > 0)


class PrefixTails:
    """Kept tails of every tenant; the owner bounds their bytes (see `keep` and `discard`)."""

    def __init__(self, fingerprint: str, page_size: int) -> None:
        self.page_size = page_size
        self._tenant: TenantIndexes[Rows] = TenantIndexes(fingerprint)

    def find(self, job: RecoveryJob) -> tuple[int, Rows] | None:
        """The longest kept tail that continues `job`'s prefix inside its claim, ending before
        the claim does: (b, rows [job.start, b)), or None."""
        if job.start % self.page_size:
            return None
        index = self._tenant(job.tenant)
        for b in range(min(job.start + self.page_size - 1, job.end - 1), job.start, -1):
            rows = index.get(job.token_ids[:b], TAIL)
            if rows is not None:
                return b, rows
        return None

    def keep(
        self, job: RecoveryJob, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[tuple[int, ...], int]]:
        """Keep the tails at `job`'s boundaries from its written rows [start, end) (k, v); the
        token prefixes they were filed under, with their bytes (less than a page of rows each)."""
        filed = []
        for b in boundaries(job):
            a = b - b % self.page_size
            if a == b or a < job.start or b > job.end:
                continue
            rows = slice(a - job.start, b - job.start)
            prefix = tuple(job.token_ids[:b])
            tail = (k[:, rows].clone(), v[:, rows].clone())
            self._tenant(job.tenant).put(prefix, TAIL, 0, tail)
            filed.append((prefix, tail[0].nbytes + tail[1].nbytes))
        return filed

    def discard(self, tenant: str | None, prefix: Sequence[int]) -> None:
        self._tenant(tenant).discard(prefix, TAIL)


class TailPages:
    """An engine's pages, plus the kept tails that continue some jobs' prefixes (by block ids:
    each request's own)."""

    def __init__(self, pages: PrefixReader) -> None:
        self.pages = pages
        self._tails: dict[tuple[int, ...], tuple[int, Rows]] = {}

    def add(self, job: RecoveryJob, rows: Rows) -> None:
        self._tails[tuple(job.block_ids)] = (job.start, rows)

    def of(self, job: RecoveryJob) -> Rows | None:
        held = self._tails.get(tuple(job.block_ids))
        return None if held is None else held[1]

    def read(
        self, block_ids: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._tails.get(tuple(block_ids))
        if held is None:
            return self.pages.read(block_ids, positions)
        start, (k, v) = held
        kept = (positions >= start).nonzero().flatten()
        if len(kept) == 0:
            return self.pages.read(block_ids, positions)
        # The tail's rows lie in the request's own pages (not written yet): read every row from
        # the pages (a page at a time where the positions are consecutive), then the tail's over
        # theirs.
        out_k, out_v = self.pages.read(block_ids, positions)
        out_k[:, kept] = k[:, positions[kept] - start]
        out_v[:, kept] = v[:, positions[kept] - start]
        return out_k, out_v
