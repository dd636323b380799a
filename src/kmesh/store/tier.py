"""Where the store keeps entries: the `Tier` interface and the local shared-memory tier.

An entry is the published state of one (key, tenant): a shared memory segment holding an opaque
payload, its CRC-32 and a small opaque metadata blob. The store (server.py) decides who may write
what and when; a tier only keeps bytes and accounts for them: `reserve` makes room for a payload
that a leader is about to write, `commit` turns the reservation into a visible entry, `lookup`
finds entries and marks them recently used, `pin`/`unpin` declare (and take back) a family's future
use of an entry, `drop` forgets one.

SharedMemoryTier holds one POSIX shared memory segment per entry, named for its store's process
and at random (a name says nothing about its key; a dead store's are freed by the next one to
start: kmesh/store/orphans.py). Capacity counts committed and reserved payload bytes. Which entry
goes first is kmesh/coord/future_use.py's order (`retention`: future_use, pins soft; or lru, pins
hard). A reserve evicts in that order until the payload fits, and is refused without evicting
anything when it could not fit even then (too large for the store, or the rest reserved, or
pinned under lru). Segments are
created zero-filled with their pages allocated (posix_fallocate), so a writer can never be killed
by SIGBUS on a full /dev/shm; the store process keeps no mapping or descriptor open per entry.
A segment that a client still maps when it is unlinked stays readable by that client until it
closes its mapping (POSIX semantics), so eviction never pulls state from under a reader.

Spare segments: a client may ask for segments made ahead (`make_spares`), fault their pages in
from its own process (writing zeros) and hand them back (`warmed`); a later reservation of
exactly that size takes a warm spare instead of fresh memory. On a virtual machine that returns
freed memory to its host, a write into never-touched pages runs at a tenth of memory speed
(docs/design/performance.md); vLLM touches its own KV cache once, at start, and the spares let
the store's memory be touched at start too. Spares hold no entry: they never reach a reader, they
are given up (unlinked) before any entry is evicted for room, and capacity bounds entries,
reservations and spares together.

A remote tier (remote/mooncake_tier.py) stands behind this one: the store looks a local miss up
there and copies the bytes into a reserved local segment (`fill`), so clients only ever see local
segment handles (remote/front.py).
"""

import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Protocol

from kmesh.coord.future_use import EvictionOrder
from kmesh.errors import KMeshError
from kmesh.store.orphans import segment_prefix

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
    spares: int  # spare segments made ahead, warm or not yet
    evicted: int
    dropped: int


class Tier(Protocol):
    def lookup(self, ident: EntryId) -> StoredEntry | None:
        """The entry, marked as just used, or None."""

    def reserve(self, size: int) -> str:
        """Room for a payload of `size` bytes (evicting if needed): a segment name to write to.
        Raises CapacityError if it cannot fit."""

    def fill(self, name: str, payload: bytes) -> None:
        """Write a reservation's payload here (one copied from elsewhere: the remote tier)."""

    def cancel(self, name: str) -> None:
        """Give back a reservation that will not be committed."""

    def commit(self, ident: EntryId, name: str, checksum: int, meta: bytes) -> StoredEntry:
        """Make reservation `name` the entry of `ident` (replacing any entry it had)."""

    def drop(self, ident: EntryId, name: str | None = None) -> bool:
        """Forget the entry of `ident` (only if its segment is `name`, when given)."""

    def pin(self, ident: EntryId, next_use: float | None = None) -> StoredEntry | None:
        """Add a pin to the entry of `ident`, declaring its next use (None: no such entry)."""

    def declare(self, ident: EntryId, next_use: float, was: float | None) -> None:
        """A new date for one pin of the entry, which held `was` (nothing if it has no pin)."""

    def unpin(self, ident: EntryId, serial: int, was: float | None) -> None:
        """Take back a pin dated `was` from entry `serial` of `ident` (nothing if that entry is
        gone)."""

    def make_spares(self, size: int, count: int) -> list[str]:
        """Up to `count` spare segments of `size` bytes, as many as fit in the free room; none is
        handed out before `warmed` names it."""

    def warmed(self, names: list[str]) -> int:
        """Spares whose pages were faulted in: later reservations of their size take them."""

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
    """Entries in POSIX shared memory, at most `capacity` payload bytes, evicted in the order of
    `retention` (kmesh/coord/future_use.py)."""

    def __init__(self, capacity: int, retention: str = "future_use") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._prefix = segment_prefix()
        self._entries: dict[EntryId, StoredEntry] = {}
        self._order = EvictionOrder[EntryId](retention)
        self._reserved: dict[str, int] = {}
        self._cold: dict[str, int] = {}  # spares made, not warmed yet -> size
        self._warm: dict[int, list[str]] = {}  # size -> warm spares
        self._spare_bytes = 0
        self._used = 0  # entries and reservations
        self._serial = 0
        self._evicted = 0
        self._dropped = 0

    @property
    def retention(self) -> str:
        return self._order.retention

    def lookup(self, ident: EntryId) -> StoredEntry | None:
        entry = self._entries.get(ident)
        if entry is not None:
            self._order.touch(ident)
        return entry

    def reserve(self, size: int) -> str:
        if size < 1:
            raise ValueError(f"a reservation needs at least one byte, got {size}")
        if size > self.capacity:
            raise CapacityError(
                "too_large",
                f"a payload of {size} bytes exceeds the store's capacity of {self.capacity} bytes",
            )
        excess = self._used + size - self.capacity
        if excess > self._order.evictable:
            raise CapacityError(
                "full",
                f"no room for {size} bytes: {self._used} of {self.capacity} bytes are in use and "
                f"only {self._order.evictable} can be evicted (the rest is pinned or being "
                "published)",
            )
        name = self._take_spare(size)
        if name is None:
            while self._spare_bytes and self._used + self._spare_bytes + size > self.capacity:
                self._give_up_spare()
            while self._used + size > self.capacity:
                victim = self._order.victim()
                assert victim is not None  # evictable bytes cover the excess
                self._remove(victim)
                self._evicted += 1
            name = self._new_segment(size)
        self._reserved[name] = size
        self._used += size
        return name

    def make_spares(self, size: int, count: int) -> list[str]:
        if size < 1:
            raise ValueError(f"a spare needs at least one byte, got {size}")
        room = self.capacity - self._used - self._spare_bytes
        names = []
        for _ in range(min(count, room // size)):
            try:
                name = self._new_segment(size)
            except CapacityError:  # /dev/shm is full: fewer spares, nothing else changes
                break
            self._cold[name] = size
            self._spare_bytes += size
            names.append(name)
        return names

    def warmed(self, names: list[str]) -> int:
        count = 0
        for name in names:
            size = self._cold.pop(name, None)
            if size is not None:  # unknown names (given up meanwhile, or never made): ignored
                self._warm.setdefault(size, []).append(name)
                count += 1
        return count

    def _take_spare(self, size: int) -> str | None:
        spares = self._warm.get(size)
        if not spares:
            return None
        self._spare_bytes -= size
        return spares.pop()

    def _give_up_spare(self) -> None:
        """Unlink one spare, a warm one first (a cold one's warming client finds it gone)."""
        size = next((s for s, names in self._warm.items() if names), None)
        if size is not None:
            name = self._warm[size].pop()
        else:
            name, size = self._cold.popitem()
        self._spare_bytes -= size
        _unlink_segment(name)

    def _new_segment(self, size: int) -> str:
        name = self._prefix + secrets.token_hex(12)
        try:
            _create_segment(name, size)
        except OSError as error:
            raise CapacityError(
                "no_memory", f"could not create a shared memory segment of {size} bytes: {error}"
            ) from None
        return name

    def fill(self, name: str, payload: bytes) -> None:
        segment = shared_memory.SharedMemory(name)
        try:
            assert segment.buf is not None
            segment.buf[: len(payload)] = payload
        finally:
            segment.close()

    def cancel(self, name: str) -> None:
        self._used -= self._reserved.pop(name)
        _unlink_segment(name)

    def commit(self, ident: EntryId, name: str, checksum: int, meta: bytes) -> StoredEntry:
        size = self._reserved.pop(name)
        self._used -= size  # counted again below, as an entry
        self._remove(ident)
        self._serial += 1
        entry = StoredEntry(self._serial, name, size, checksum, meta)
        self._entries[ident] = entry
        self._order.add(ident, size)
        self._used += size
        return entry

    def drop(self, ident: EntryId, name: str | None = None) -> bool:
        dropped = self._remove(ident, name)
        self._dropped += dropped
        return dropped

    def pin(self, ident: EntryId, next_use: float | None = None) -> StoredEntry | None:
        entry = self._entries.get(ident)
        if entry is not None:
            self._order.pin(ident, next_use)
        return entry

    def declare(self, ident: EntryId, next_use: float, was: float | None) -> None:
        if ident in self._entries:
            self._order.declare(ident, next_use, was)

    def unpin(self, ident: EntryId, serial: int, was: float | None) -> None:
        entry = self._entries.get(ident)
        if entry is not None and entry.serial == serial:
            self._order.unpin(ident, was)

    def stats(self) -> TierStats:
        return TierStats(
            capacity=self.capacity,
            used=self._used,
            entries=len(self._entries),
            pinned=self._order.pinned,
            reserved=len(self._reserved),
            spares=len(self._cold) + sum(map(len, self._warm.values())),
            evicted=self._evicted,
            dropped=self._dropped,
        )

    def close(self) -> None:
        names = [entry.name for entry in self._entries.values()]
        names += list(self._reserved)
        names += list(self._cold) + [name for spares in self._warm.values() for name in spares]
        for ident in list(self._entries):
            self._order.remove(ident)
        self._entries.clear()
        self._reserved.clear()
        self._cold.clear()
        self._warm.clear()
        self._used = self._spare_bytes = 0
        for name in names:
            _unlink_segment(name)

    def _remove(self, ident: EntryId, name: str | None = None) -> bool:
        entry = self._entries.get(ident)
        if entry is None or (name is not None and entry.name != name):
            return False
        del self._entries[ident]
        self._order.remove(ident)
        self._free(entry)
        return True

    def _free(self, entry: StoredEntry) -> None:
        self._used -= entry.size
        _unlink_segment(entry.name)
