"""An engine's link to a `kmesh store serve` process: the exact blocks it restores and publishes
(engine/block_store.py), what its recovery shares with the other engines on the store (masters,
transcripts, segments: store/shared/state.py), and the pins of the families its requests
declare (store/family_pins.py: a transcript at its `next_use`). A store error there is logged
and the engine goes on without the pin."""

import logging
from dataclasses import dataclass

from kmesh.compute.config import ModelConfig
from kmesh.engine.block_store import BlockStore
from kmesh.engine.request import Request
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.recovery.shared import SharedState
from kmesh.store import StoreError, TenantClients
from kmesh.store.family_pins import FamilyPins
from kmesh.store.shared.state import shared_through

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreLink:
    blocks: BlockStore
    # One connection per tenant, for what recovery shares.
    clients: TenantClients
    shared: SharedState
    pins: FamilyPins

    @classmethod
    def open(
        cls, socket: str, cache: PagedKVCache, model_fingerprint: str, config: ModelConfig
    ) -> "StoreLink":
        """Link to the store at `socket` (connections open on first use)."""
        clients = TenantClients(socket)
        shared = shared_through(clients, model_fingerprint, config)
        return cls(BlockStore(socket, cache), clients, shared, FamilyPins(clients))

    def pin_transcript(self, request: Request, keys: tuple[bytes, ...]) -> None:
        """Pin a request's transcript entries for its family at its declared next use."""
        declared = request.kmesh
        if declared is None or declared.family is None or declared.next_use is None:
            return
        try:
            self.pins.pin(declared.family, request.tenant_salt, keys, declared.next_use)
        except StoreError as error:
            log.info("kmesh store: %s's transcript not pinned: %s", request.request_id, error)

    def end_member(self, request: Request) -> None:
        """A request finished: close the pins of the families that ended with it."""
        if request.kmesh is None:
            return
        try:
            self.pins.end_member(request.kmesh, request.tenant_salt)
        except StoreError as error:
            log.info("kmesh store: a family's pins not closed: %s", error)

    def close(self) -> None:
        """Close the store connections (they reopen on the next use)."""
        self.blocks.close()
        self.clients.close()
