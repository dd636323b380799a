"""What recovery shares beyond one engine, as recovery needs it: the interface the store implements.

An engine's recovery (requests.py) may share three kinds of state with the other engines on a
store; it owns the protocols here, and the store implements them (kmesh/store/shared/: the
engines wire the two together with `shared_through`), so recovery never imports the store:
- rounds' masters (`SharedMasters`): one an engine builds is published, and a round whose master
  it lacks looks there first, so the siblings of a round spread over several engines mirror the
  one master the first of them built, as if they ran on one;
- jobs' transcripts (`SharedTranscripts`): a job with segments first restores the rows of its
  transcript the store holds past its start (published by an earlier job of any engine: the
  same rows, bit for bit; a `Chain` of pieces, `Restored`) and recovers only the rest; once its
  rows are written, it publishes its own transcript's new rows;
- first readers' segments (`SharedSegments`, segment_store.py).

Every failure to share is a miss (the engine computes) or something not shared: no method raises
for the store's sake.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kmesh.kv.master_mirror import Master
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.jobs import PrefixReader, RecoveryJob, RoundKey, RoundMirrors


@dataclass(frozen=True, slots=True)
class Chain:
    """A transcript's pieces in the store, first to last."""

    keys: tuple[bytes, ...] = ()
    ends: tuple[int, ...] = ()  # each piece's end; a piece starts where the one before ends

    @property
    def end(self) -> int:
        return self.ends[-1] if self.ends else 0

    def then(self, key: bytes, end: int) -> "Chain":
        return Chain((*self.keys, key), (*self.ends, end))


@dataclass(frozen=True, slots=True, eq=False)  # tensor fields: no value equality
class Restored:
    """What a restore found: the chain (to publish after), and its rows after the job's start."""

    chain: Chain
    k: torch.Tensor | None  # [layers, chain.end - job.start, kv_heads, head_dim], None: no rows
    v: torch.Tensor | None
    nbytes: int = 0  # read from the store (pieces and masters)


class SharedMasters(Protocol):
    """Rounds' masters shared beyond one engine, by round and the round's segments' tokens (in
    its canonical order); `master_choice` tells masters built differently apart."""

    def get(self, key: RoundKey, master_choice: str, tokens: Sequence[int]) -> Master | None: ...

    def put(
        self, key: RoundKey, master_choice: str, tokens: Sequence[int], master: Master
    ) -> None: ...


class SharedTranscripts(Protocol):
    """Jobs' transcripts shared beyond one engine (see the module docstring)."""

    def restore(self, job: RecoveryJob, have: int) -> Restored:
        """The job's transcript as far as it is shared, and its rows after job.start if it
        reaches past `have` (the engine holds the rows before that: nothing is read)."""
        ...

    def publish(
        self, job: RecoveryJob, chain: Chain, pages: PrefixReader, mirrors: RoundMirrors | None
    ) -> tuple[bytes, ...]:
        """Publish the job's rows from `chain`'s end on (rows [0, job.end) are in `pages`);
        the keys of the entries its next prompt reads (what a declared next use pins)."""
        ...


class SharedSegments(Protocol):
    """First readers' segments shared beyond one engine, by tenant and tokens."""

    def get(self, tenant: str | None, tokens: Sequence[int]) -> SegmentKV | None: ...

    def put(self, tenant: str | None, tokens: Sequence[int], segment: SegmentKV) -> None: ...


@dataclass(frozen=True, slots=True)
class SharedState:
    """What recovery shares beyond one engine (the store's: kmesh/store/shared/)."""

    masters: SharedMasters
    transcripts: SharedTranscripts
    segments: SharedSegments
