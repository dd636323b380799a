"""What a store client raises. Every failure to use the store is a StoreError, so the caller's
fallback is always "compute it here": StoreUnavailable (socket error, store gone, timeout, protocol
error: the client is closed after it), StoreRefused (a publish that does not fit: keep the computed
state locally) and EntryLost (a hit whose segment failed its checksum, reported to the store which
dropped it, or vanished).
"""

from kmesh.errors import KMeshError


class StoreError(KMeshError):
    """The store cannot serve this: compute the state here instead."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or answered wrongly; this client is closed."""


class StoreRefused(StoreError):
    """The store refused a publish (`code`: too_large, full, no_memory, not_leader,
    not_reserved); the key's claim is gone, keep the computed state locally."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class EntryLost(StoreError):
    """A hit cannot be read: its bytes failed the checksum (the store was told and dropped the
    entry) or its segment is gone."""
