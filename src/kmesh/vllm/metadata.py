"""What the connector's two halves tell each other each step.

Scheduler -> worker (KMeshConnectorMetadata): the blocks to fill from the store before the forward
pass, the requests whose claimed rows recovery fills, the blocks to copy into segments the store
reserved after it, and the finished requests whose generated rows to keep (their blocks stay
allocated until the worker says it has read them: vLLM's delayed free), and the page tails to keep,
copy and drop (page_tails.py). Worker -> scheduler
(KMeshWorkerMetadata): the checksum of each copied block (to commit it) or None (to abandon it), and
each recovered request's report. The store protocol (claims, commits, pins) stays on the scheduler
side; the worker only moves bytes between shared memory and vLLM's KV cache, and fills recovered
rows.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kmesh.recovery.jobs import RecoveryJob, RecoveryReport
from kmesh.store import Hit
from kmesh.store.policy import TenantKey


@dataclass(frozen=True, slots=True)
class LoadBlock:
    tenant: str | None
    block_id: int
    hit: Hit


@dataclass(frozen=True, slots=True)
class SaveBlock:
    tenant: str | None
    block_id: int
    key: bytes
    segment: str  # reserved by the scheduler side


@dataclass(frozen=True, slots=True)
class KeepOutput:
    """A finished request's generated tokens whose KV (rows start.., in its blocks) to keep."""

    request_id: str
    tenant: str | None
    token_ids: list[int]  # the generated tokens fed back (every one but the last)
    block_ids: list[int]
    start: int  # the first generated token's position (the prompt's length)


@dataclass(frozen=True, slots=True)
class KeepTail:
    """Rows [start, end) of a request's blocks to keep as tail `tail_id` (page_tails.py)."""

    tail_id: int
    block_ids: list[int]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class CopyTail:
    """Rows [start, end) of kept tail `tail_id` to copy into a request's blocks."""

    tail_id: int
    block_ids: list[int]
    start: int
    end: int


@dataclass
class KMeshConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadBlock] = field(default_factory=list)
    saves: list[SaveBlock] = field(default_factory=list)
    recoveries: list[RecoveryJob] = field(default_factory=list)
    outputs: list[KeepOutput] = field(default_factory=list)
    tail_copies: list[CopyTail] = field(default_factory=list)  # before the forward pass
    # Of requests finished last step: read from their freed blocks, which this step left free.
    finished_tails: list[KeepTail] = field(default_factory=list)
    prompt_tails: list[KeepTail] = field(default_factory=list)  # after it
    dropped_tails: list[int] = field(default_factory=list)  # after it


@dataclass
class KMeshWorkerMetadata(KVConnectorWorkerMetadata):
    saved: dict[TenantKey, int | None] = field(default_factory=dict)
    recovered: dict[str, RecoveryReport] = field(default_factory=dict)  # by request id
    # By request id: the store keys of its transcript's entries (RecoveredRows.transcript).
    transcripts: dict[str, tuple[bytes, ...]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KMeshWorkerMetadata)
        return KMeshWorkerMetadata(
            {**self.saved, **other.saved},
            {**self.recovered, **other.recovered},
            {**self.transcripts, **other.transcripts},
        )
