"""A store process that shares keyed inference state between engines through shared memory.

`kmesh store serve` runs the store (server.py); engines talk to it with StoreClient (client.py)
over the protocol of protocol.py, documented in docs/STORE_PROTOCOL.md; tier.py keeps the bytes.
"""

from kmesh.store.client import (
    Acquired,
    EntryLost,
    Hit,
    Mapped,
    StoreClient,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    TenantClients,
)

__all__ = [
    "Acquired",
    "EntryLost",
    "Hit",
    "Mapped",
    "StoreClient",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "TenantClients",
]
