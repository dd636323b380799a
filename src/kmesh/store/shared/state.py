"""What an engine's recovery shares with the other engines on a store (recovery/shared.py's
SharedState, which the store implements here): rounds' masters (masters.py), jobs' transcripts
(transcripts.py) and first readers' segments (`StoreSegments`), each under the request's tenant.
Every store failure is a miss (the engine computes) or something not shared. The engines wire
recovery to the store with `shared_through`.

- A shared segment a per-request job computed in full (its first reader's KV, at canonical
  positions: kv/segment_kv.py) is published; an engine lacking it reads it before computing it.
  Kept outputs (a reader finds one inside a segment by its tokens: index/segment_index.py's
  `find_within`) stay in their engine: a keyed store cannot answer "which entry lies inside".
"""

import logging
from collections.abc import Sequence

from kmesh.compute.config import ModelConfig
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.shared import SharedState
from kmesh.state.keys import KeyNamespace, segment_key
from kmesh.store.errors import StoreError
from kmesh.store.shared.group_state import (
    fetch,
    publish,
    read_segment,
    segment_payload,
)
from kmesh.store.shared.masters import StoreMasters
from kmesh.store.shared.transcripts import StoreTranscripts
from kmesh.store.tenant_clients import TenantClients

log = logging.getLogger(__name__)
FIRST_READER = "first-reader"


def shared_through(clients: TenantClients, fingerprint: str, config: ModelConfig) -> SharedState:
    """What recovery on a model (`fingerprint`, `config`) shares through the store of `clients`."""
    masters = StoreMasters(clients, fingerprint, config)
    return SharedState(masters, StoreTranscripts(masters), StoreSegments(clients, fingerprint))


class StoreSegments:
    """First readers' segments shared through the store (recovery/shared.py's
    SharedSegments): one entry per tenant and tokens."""

    def __init__(self, clients: TenantClients, fingerprint: str) -> None:
        self.clients = clients
        self.fingerprint = fingerprint

    def get(self, tenant: str | None, tokens: Sequence[int]) -> SegmentKV | None:
        try:
            got = fetch(self.clients(tenant), self._key(tenant, tokens), read_segment)
        except StoreError as error:
            log.info("kmesh: a segment not read from the store: %s", error)
            return None
        if got is None or len(got[0]) != len(tokens):
            return None
        return got[0]

    def put(self, tenant: str | None, tokens: Sequence[int], segment: SegmentKV) -> None:
        client = self.clients(tenant)
        key = self._key(tenant, tokens)
        try:
            if client.acquire([key]).lead:
                publish(client, key, segment_payload(segment))
        except StoreError as error:
            log.info("kmesh: a segment not published: %s", error)

    def _key(self, tenant: str | None, tokens: Sequence[int]) -> bytes:
        namespace = KeyNamespace(self.fingerprint, tenant_salt=tenant)
        return segment_key(namespace, tokens, FIRST_READER)
