"""A store process that shares keyed inference state between engines through shared memory.

`kmesh store serve` runs the store (server.py: the socket loop over state_machine.py, which
coordinates through kmesh/coord/); engines talk to it with StoreClient (client.py) over the
protocol of protocol.py, documented in docs/reference/store-protocol.md; tier.py keeps the bytes and
segments.py maps them in a client. policy.py is the per-request policy both engines follow.
Two rooms: remote/ is the remote tier behind the local one (Mooncake Store, across machines);
shared/ is what engines' recovery shares through the store (recovery/shared.py's interface).
"""

from kmesh.store.client import StoreClient
from kmesh.store.errors import EntryLost, StoreError, StoreRefused, StoreUnavailable
from kmesh.store.hits import Acquired, Hit
from kmesh.store.segments import Mapped
from kmesh.store.tenant_clients import TenantClients

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
