"""Rounds' masters through the store (recovery/shared.py's SharedMasters), for either engine.

A round's master one engine builds is published under its tenant; an engine lacking it reads it
before building its own, so a round spread over several engines mirrors the master the first of
them built. Members' mirrored transcript pieces (transcripts.py) name a master's entry by `key`.
Every store failure is a miss: the engine builds its own.
"""

import json
import logging
from collections.abc import Sequence

from kmesh.compute.config import ModelConfig
from kmesh.kv.master_mirror import Master
from kmesh.recovery.jobs import RoundKey
from kmesh.state.keys import KeyNamespace, segment_key
from kmesh.store.errors import StoreError
from kmesh.store.shared.group_state import fetch_master, master_payload, publish
from kmesh.store.tenant_clients import TenantClients

log = logging.getLogger(__name__)


class StoreMasters:
    """Rounds' masters shared through the store (see the module docstring)."""

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
        # JSON, not a joined string: family "a/b", round "c" is not family "a", round "b/c".
        context = json.dumps(["round-master", master_choice, key.family, key.round_id])
        return segment_key(namespace, tokens, context)
