"""What the connector's two halves tell each other each step.

Scheduler -> worker (KMeshConnectorMetadata): the blocks to fill from the store before the
forward pass, the requests whose claimed rows recovery fills, and the blocks to copy into segments
the store reserved after it. Worker -> scheduler (KMeshWorkerMetadata): the checksum of each copied
block (to commit it) or None (to abandon it), and each recovered request's report. The store
protocol (claims, commits, pins) stays on the scheduler side; the worker only moves bytes between
shared memory and vLLM's KV cache, and fills recovered rows.
"""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kmesh.state.request_meta import RecoverySpec
from kmesh.store import Hit

# (tenant salt, key): entries are filed per tenant in the store.
TenantKey = tuple[str | None, bytes]


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
class SegmentSpan:
    start: int  # [start, end) in the prompt's token ids
    end: int
    role: str  # shared | private | instruction
    segment_id: str | None


@dataclass(frozen=True, slots=True)
class RecoverTokens:
    """Fill the request's rows [start, end) by recovery (kmesh/vllm/recovery.py); vLLM
    computes the rest of the prompt after them."""

    request_id: str
    token_ids: list[int]  # the whole prompt
    block_ids: list[int]
    start: int  # vLLM's local prefix hit: rows [0, start) are exact KV already in the pages
    end: int
    tenant: str | None  # cache_salt: the namespace of the stored segment KV
    spans: list[SegmentSpan]  # the prompt's segments (empty without segments)
    spec: RecoverySpec
    family: str | None


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What recovering one request cost and how far it was from exact."""

    computed_tokens: float  # token-layers / layers, by KMesh's executor for this request
    shared_computed_tokens: float  # a round's master, paid by the sibling that built it
    master_bytes: int  # the size of the master this request built (kept by the worker), else 0
    mirror_bytes: int  # its mirrors: indices + the block-sparse diff against the master
    reused_tokens: int  # claimed tokens whose KV came from stored segment KV (re-rotated)
    deviation: float | None  # mean relative key deviation at the check layer, if computed
    fell_back: bool  # the gate sent the claimed tokens back to vLLM's prefill


@dataclass
class KMeshConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadBlock] = field(default_factory=list)
    saves: list[SaveBlock] = field(default_factory=list)
    recoveries: list[RecoverTokens] = field(default_factory=list)


@dataclass
class KMeshWorkerMetadata(KVConnectorWorkerMetadata):
    saved: dict[TenantKey, int | None] = field(default_factory=dict)
    recovered: dict[str, RecoveryReport] = field(default_factory=dict)  # by request id

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KMeshWorkerMetadata)
        return KMeshWorkerMetadata(
            {**self.saved, **other.saved}, {**self.recovered, **other.recovered}
        )
