"""What an engine's recovery shares with the other engines on a store (recovery/requests.py's
SharedState): rounds' masters (`StoreMasters`), jobs' transcripts (transcripts.py) and first
readers' segments (`StoreSegments`), each under the request's tenant. Every store failure is a
miss (the engine computes) or something not shared.

- A round's master one engine builds is published; an engine lacking it reads it before building
  its own, so a round spread over several engines mirrors the master the first of them built.
- A shared segment a per-request job computed in full (its first reader's KV, at canonical
  positions: kv/segment_kv.py) is published; an engine lacking it reads it before computing it.
  Kept outputs (a reader finds one inside a segment by its tokens: index/segment_index.py's
  `find_within`) stay in their engine: a keyed store cannot answer "which entry lies inside".
"""

import logging
from collections.abc import Sequence

from kmesh.compute.config import ModelConfig
from kmesh.kv.master_mirror import Master
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.jobs import RoundKey
from kmesh.recovery.shared import SharedState
from kmesh.state.keys import KeyNamespace, segment_key
from kmesh.store.errors import StoreError
from kmesh.store.group_state import (
    fetch,
    fetch_master,
    master_payload,
    publish,
    read_segment,
    segment_payload,
)
from kmesh.store.tenant_clients import TenantClients
from kmesh.store.transcripts import StoreTranscripts

log = logging.getLogger(__name__)
FIRST_READER = "first-reader"


def shared_through(clients: TenantClients, fingerprint: str, config: ModelConfig) -> SharedState:
    """What recovery on a model (`fingerprint`, `config`) shares through the store of `clients`."""
    masters = StoreMasters(clients, fingerprint, config)
    return SharedState(masters, StoreTranscripts(masters), StoreSegments(clients, fingerprint))


class StoreMasters:
    """Rounds' masters shared through the store (recovery/requests.py::SharedMasters): one an
    engine builds is published under its tenant, one it lacks is read from there. Every store
    failure is a miss: the engine builds its own."""

    def __init__(self, clients: TenantClients, fingerprint: str, config: ModelConfig) -> None:
        self.clients = clients
        self.fingerprint = fingerprint
        self.config = config

    def get(self, key: RoundKey, master_choice: str, tokens: Sequence[int]) -> Master | None:
        client = self.clients(key.tenant)
        try:
            read = fetch_master(client, self.key(key, master_choice, tokens), self.config)
        except StoreError as error:
            log.info("kmesh: round %s's master not read from the store: %s", key.round_id, error)
            return None
        return None if read is None else read[0]

    def put(self, key: RoundKey, master_choice: str, tokens: Sequence[int], master: Master) -> None:
        client = self.clients(key.tenant)
        entry_key = self.key(key, master_choice, tokens)
        try:
            if client.acquire([entry_key]).lead:
                publish(client, entry_key, master_payload(master))
        except StoreError as error:
            log.info("kmesh: round %s's master not published: %s", key.round_id, error)

    def key(self, key: RoundKey, master_choice: str, tokens: Sequence[int]) -> bytes:
        """The store key of a round's master: its tenant, family, round, how it was built and
        its segments' tokens (canonical order)."""
        namespace = KeyNamespace(self.fingerprint, tenant_salt=key.tenant)
        context = f"round-master/{master_choice}/{key.family}/{key.round_id}"
        return segment_key(namespace, tokens, context)


class StoreSegments:
    """First readers' segments shared through the store (recovery/segment_store.py's
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
