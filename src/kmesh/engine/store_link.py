"""An engine's link to a `kmesh store serve` process: the exact blocks it restores and publishes
(engine/block_store.py), and what its recovery shares with the other engines on the store
(masters, transcripts, segments: store/shared/state.py)."""

from dataclasses import dataclass

from kmesh.compute.config import ModelConfig
from kmesh.engine.block_store import BlockStore
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.recovery.shared import SharedState
from kmesh.store import TenantClients
from kmesh.store.shared.state import shared_through


@dataclass(slots=True)
class StoreLink:
    blocks: BlockStore
    # One connection per tenant, for what recovery shares.
    clients: TenantClients
    shared: SharedState

    @classmethod
    def open(
        cls, socket: str, cache: PagedKVCache, model_fingerprint: str, config: ModelConfig
    ) -> "StoreLink":
        """Link to the store at `socket` (connections open on first use)."""
        clients = TenantClients(socket)
        shared = shared_through(clients, model_fingerprint, config)
        return cls(BlockStore(socket, cache), clients, shared)

    def close(self) -> None:
        """Close the store connections (they reopen on the next use)."""
        self.blocks.close()
        self.clients.close()
