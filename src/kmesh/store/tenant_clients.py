"""One StoreClient per tenant salt on one socket, for an engine that serves many tenants."""

import os
import threading
from collections import OrderedDict

from kmesh.store.client import STORE_KEY_ENV, StoreClient

# Connections kept open per TenantClients when they hold nothing. One engine has a few
# TenantClients (its block store, its shared state and pins, a vLLM worker's reads), and one store
# serves every engine on the machine from its own descriptors (a soft limit of 1024 by default):
# 64 each keeps a handful of engines well inside that, and still covers the tenants of a running
# batch, so that reopening (a connect, and a hello with an API key) stays rare.
MAX_OPEN_CLIENTS = 64


class TenantClients:
    """One StoreClient per tenant salt on one socket, opened on first use (the store files
    entries by tenant, and a client speaks for one), each with the API key in STORE_KEY_ENV if
    that is set.

    Invariant: at most `max_open` clients are open, unless more of them hold something the store
    ties to their connection (StoreClient.holding: pins, claims, reservations), which closing
    would break. Opening one past `max_open` first closes the least recently used clients that
    hold nothing; if every client holds something, the cap is exceeded rather than one of them
    closed. A closed tenant's client is opened again on its next use (what it published stays in
    the store).
    NOTE: a client returned here may be closed once `max_open` other tenants have been used since
    (fewer, if their clients hold things): use it right away, and ask again for the next use.
    """

    def __init__(self, socket_path: str, max_open: int = MAX_OPEN_CLIENTS) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, got {max_open}")
        self.socket_path = socket_path
        self.max_open = max_open
        self.key = os.environ.get(STORE_KEY_ENV) or None
        self._clients: OrderedDict[str | None, StoreClient] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    @property
    def num_open(self) -> int:
        return len(self._clients)

    def __call__(self, tenant: str | None) -> StoreClient:
        with self._lock:
            client = self._clients.get(tenant)
            if client is not None:
                self._clients.move_to_end(tenant)
                return client
            self._make_room()
            client = StoreClient(self.socket_path, tenant=tenant, key=self.key)
            self._clients[tenant] = client
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _make_room(self) -> None:
        """Close the least recently used idle clients so that one more fits under max_open."""
        excess = len(self._clients) + 1 - self.max_open
        if excess <= 0:
            return
        idle = [tenant for tenant, client in self._clients.items() if not client.holding]
        for tenant in idle[:excess]:
            self._clients.pop(tenant).close()
