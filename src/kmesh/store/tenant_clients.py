"""One StoreClient per tenant salt on one socket, for an engine that serves many tenants."""

import os

from kmesh.store.client import STORE_KEY_ENV, StoreClient


class TenantClients:
    """One StoreClient per tenant salt on one socket, opened on first use (the store files
    entries by tenant, and a client speaks for one), each with the API key in STORE_KEY_ENV if
    that is set."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.key = os.environ.get(STORE_KEY_ENV) or None
        self._clients: dict[str | None, StoreClient] = {}

    def __call__(self, tenant: str | None) -> StoreClient:
        if tenant not in self._clients:
            self._clients[tenant] = StoreClient(self.socket_path, tenant=tenant, key=self.key)
        return self._clients[tenant]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
