"""Where the store keeps entries: the `Tier` interface and the local shared-memory tier.

An entry is the published state of one (key, tenant): a shared memory segment holding an opaque
payload, its CRC-32 and a small opaque metadata blob. The store (server.py) decides who may write
what and when; a tier only keeps bytes and accounts for them: `reserve` makes room for a payload
that a leader is about to write, `commit` turns the reservation into a visible entry, `lookup`
finds entries and marks them recently used, `pin`/`unpin` protect entries from eviction, `drop`
forgets one.

SharedMemoryTier holds one POSIX shared memory segment per entry, named at random (a name says
nothing about its key). Capacity counts committed and reserved payload bytes. Unpinned entries sit
in an OrderedDict in least-recently-used order; pinned ones move to a separate map and come back
as most recent when their last pin goes, so eviction only ever walks evictable entries. A reserve
evicts from the old end until the payload fits, and is refused without evicting anything when it
could not fit even then (too large for the store, or the rest pinned or reserved). Segments are
created zero-filled with their pages allocated (posix_fallocate), so a writer can never be killed
by SIGBUS on a full /dev/shm; the store process keeps no mapping or descriptor open per entry.
A segment that a client still maps when it is unlinked stays readable by that client until it
closes its mapping (POSIX semantics), so eviction never pulls state from under a reader.

A remote tier (say, a store on another machine) would implement the same interface behind the
local one: the store would look it up on a local miss and copy the bytes into a reserved local
segment, so clients keep seeing only local segment handles and never change.
"""

import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Protocol

from kmesh.errors import KMeshError

EntryId = tuple[bytes, str | None]
"""(key, tenant): entries of different tenants never meet, even under the same key."""

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared memory


class CapacityError(KMeshError):
    """A payload cannot be given room; `code` is too_large, full or no_memory."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class StoredEntry:
    serial: int  # unique per commit: a pin names the entry it pinned, not just the key
    name: str  # shared memory segment
    size: int
    checksum: int
    meta: bytes


@dataclass(frozen=True, slots=True)
class TierStats:
    capacity: int
    used: int  # committed + reserved bytes
    entries: int
    pinned: int  # entries with at least one pin
    reserved: int  # reservations not committed yet
    evicted: int
    dropped: int


class Tier(Protocol):
    def lookup(self, ident: EntryId) -> StoredEntry | None:
        """The entry, marked as just used, or None."""

    def reserve(self, size: int) -> str:
        """Room for a payload of `size` bytes (evicting if needed): a segment name to write to.
        Raises CapacityError if it cannot fit."""

    def cancel(self, name: str) -> None:
        """Give back a reservation that will not be committed."""

    def commit(self, ident: EntryId, name: str, checksum: int, meta: bytes) -> StoredEntry:
        """Make reservation `name` the entry of `ident` (replacing any entry it had)."""

    def drop(self, ident: EntryId, name: str | None = None) -> bool:
        """Forget the entry of `ident` (only if its segment is `name`, when given)."""

    def pin(self, ident: EntryId) -> StoredEntry | None:
        """Add a pin to the entry of `ident` (None: no such entry)."""

    def unpin(self, ident: EntryId, serial: int) -> None:
        """Take back a pin from entry `serial` of `ident` (nothing if that entry is gone)."""

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Forget everything and free every segment."""


def _create_segment(name: str, size: int) -> None:
    segment = shared_memory.SharedMemory(name, create=True, size=size)
    try:
        path = SHM_DIR / name
        if path.exists():  # Linux: allocate the pages now, so writing them cannot fail later
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
    except OSError:
        segment.close()
        segment.unlink()
        raise
    segment.close()


def _unlink_segment(name: str) -> None:
    try:
        segment = shared_memory.SharedMemory(name)
    except FileNotFoundError:  # already gone (removed by hand, or by a crashed store's tracker)
        return
    segment.close()
    segment.unlink()


class SharedMemoryTier:
    """Entries in POSIX shared memory, at most `capacity` payload bytes, evicted LRU-first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._prefix = f"kmesh-{secrets.token_hex(4)}-"
        self._lru: OrderedDict[EntryId, StoredEntry] = OrderedDict()
        self._pinned: dict[EntryId, tuple[StoredEntry, int]] = {}
        self._reserved: dict[str, int] = {}
        self._used = 0
        self._evictable = 0  # bytes in _lru
        self._serial = 0
        self._evicted = 0
        self._dropped = 0

    def lookup(self, ident: EntryId) -> StoredEntry | None:
        entry = self._lru.get(ident)
        if entry is not None:
            self._lru.move_to_end(ident)
            return entry
        pinned = self._pinned.get(ident)
        return None if pinned is None else pinned[0]

    def reserve(self, size: int) -> str:
        if size < 1:
            raise ValueError(f"a reservation needs at least one byte, got {size}")
        if size > self.capacity:
            raise CapacityError(
                "too_large",
                f"a payload of {size} bytes exceeds the store's capacity of {self.capacity} bytes",
            )
        excess = self._used + size - self.capacity
        if excess > self._evictable:
            raise CapacityError(
                "full",
                f"no room for {size} bytes: {self._used} of {self.capacity} bytes are in use and "
                f"only {self._evictable} can be evicted (the rest is pinned or being published)",
            )
        while self._used + size > self.capacity:
            _, entry = self._lru.popitem(last=False)
            self._evictable -= entry.size
            self._free(entry)
            self._evicted += 1
        name = self._prefix + secrets.token_hex(12)
        try:
            _create_segment(name, size)
        except OSError as error:
            raise CapacityError(
                "no_memory", f"could not create a shared memory segment of {size} bytes: {error}"
            ) from None
        self._reserved[name] = size
        self._used += size
        return name

    def cancel(self, name: str) -> None:
        self._used -= self._reserved.pop(name)
        _unlink_segment(name)

    def commit(self, ident: EntryId, name: str, checksum: int, meta: bytes) -> StoredEntry:
        size = self._reserved.pop(name)
        self._used -= size  # counted again below, as an entry
        self._remove(ident)
        self._serial += 1
        entry = StoredEntry(self._serial, name, size, checksum, meta)
        self._lru[ident] = entry
        self._evictable += size
        self._used += size
        return entry

    def drop(self, ident: EntryId, name: str | None = None) -> bool:
        dropped = self._remove(ident, name)
        self._dropped += dropped
        return dropped

    def pin(self, ident: EntryId) -> StoredEntry | None:
        entry = self._lru.pop(ident, None)
        if entry is not None:
            self._evictable -= entry.size
            self._pinned[ident] = (entry, 1)
            return entry
        pinned = self._pinned.get(ident)
        if pinned is None:
            return None
        self._pinned[ident] = (pinned[0], pinned[1] + 1)
        return pinned[0]

    def unpin(self, ident: EntryId, serial: int) -> None:
        pinned = self._pinned.get(ident)
        if pinned is None or pinned[0].serial != serial:
            return
        entry, pins = pinned
        if pins > 1:
            self._pinned[ident] = (entry, pins - 1)
            return
        del self._pinned[ident]
        self._lru[ident] = entry
        self._evictable += entry.size

    def stats(self) -> TierStats:
        return TierStats(
            capacity=self.capacity,
            used=self._used,
            entries=len(self._lru) + len(self._pinned),
            pinned=len(self._pinned),
            reserved=len(self._reserved),
            evicted=self._evicted,
            dropped=self._dropped,
        )

    def close(self) -> None:
        names = [entry.name for entry in self._lru.values()]
        names += [entry.name for entry, _ in self._pinned.values()]
        names += list(self._reserved)
        self._lru.clear()
        self._pinned.clear()
        self._reserved.clear()
        self._used = self._evictable = 0
        for name in names:
            _unlink_segment(name)

    def _remove(self, ident: EntryId, name: str | None = None) -> bool:
        entry = self.lookup(ident)
        if entry is None or (name is not None and entry.name != name):
            return False
        if self._pinned.pop(ident, None) is None:
            del self._lru[ident]
            self._evictable -= entry.size
        self._free(entry)
        return True

    def _free(self, entry: StoredEntry) -> None:
        self._used -= entry.size
        _unlink_segment(entry.name)
