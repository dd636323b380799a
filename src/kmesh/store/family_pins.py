"""What an engine pins in the store for the families its requests declare (the `kmesh` object's
`family`, `branches`, `close`), for both engines: a member's pins (vLLM: its family trunk's
blocks; either engine: its transcript at its declared `next_use`) stay while the family is open
on this engine (coord/families.py::RequestFamilies: a family is its tenant's), then its pins are
closed. The pins are this engine's store connections': if the engine dies, the store lets them
go with them.
Store errors propagate (StoreError): the caller computes without the store.
"""

from collections.abc import Callable, Sequence

from kmesh.coord.families import RequestFamilies
from kmesh.state.request_meta import KMeshParams
from kmesh.store.client import StoreClient
from kmesh.store.protocol import MAX_KEYS

# Families held open on one engine at most; past it the oldest is closed (its pins let go).
MAX_OPEN_FAMILIES = 10_000


class FamilyPins:
    """Pins by declared family over `client(salt)` (see the module docstring)."""

    def __init__(
        self, client: Callable[[str | None], StoreClient], max_open: int = MAX_OPEN_FAMILIES
    ) -> None:
        self.client = client
        self.families = RequestFamilies(max_open)

    def pin(
        self,
        family: str,
        salt: str | None,
        keys: Sequence[bytes],
        next_use: float | None = None,
    ) -> None:
        """Pin the published entries of `keys` for `family` under `salt` until it ends."""
        self.families.pinned(family, salt)
        client = self.client(salt)
        for lo in range(0, len(keys), MAX_KEYS):
            client.pin(family, keys[lo : lo + MAX_KEYS], next_use)

    def end_member(self, params: KMeshParams, salt: str | None) -> None:
        """A request under `salt` finished: close the pins of the families that ended with it."""
        for ended in self.families.end_member(params, salt):
            for pinned in ended.salts:
                self.client(pinned).close_family(ended.family_id)
