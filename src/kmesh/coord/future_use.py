"""Which stored entry goes first when the store is full: retention by declared future use, or LRU.

Callers declare future use with family pins (coord/pins.py): a family that pins an entry says it
will read it again while the family is open, and may say when (`next_use`: an ordinal or a time,
smaller is sooner; a round's member declares its place in the next round). A pin without a date
means "now or any time" (0: a request's own in-flight reads). Each pin holds its family's latest
declaration, and an entry's date is the soonest its pins hold: a family that will read it later
never postpones a sooner one's read. `EvictionOrder` keeps a tier's entries in the order they are
evicted:

future_use (the default):
1. ended: pinned once, every pinning family has closed since (a finished branch, a closed round
   or family): least recently used first;
2. undeclared: never pinned: least recently used first;
3. declared: pinned by an open family: the furthest declared next use first; among equals the most
   recently used first (state is read head to tail, a prefix chain before what extends it, and a
   lost head makes its tail useless: the tail goes first, as vLLM frees a request's blocks tail
   first). Pins are soft: a declared entry goes when nothing else is left, and the request that
   would have read it computes instead (every reader falls back on a missing entry).

lru (the baseline; the store's policy before future use): unpinned entries least recently used
first, an entry coming back as most recent when its last pin goes; pinned entries never go.

No bytes and no I/O: the tier asks `victim()` until its payload fits.
Invariants: every entry is in exactly one class; `evictable` is the total size of the entries
`victim` may return.
"""

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Ident = TypeVar("Ident", bound=Hashable)

RETENTIONS = ("future_use", "lru")
_ENDED, _UNDECLARED, _DECLARED = 0, 1, 2


@dataclass(slots=True)
class _Entry:
    size: int
    cls: int = _UNDECLARED
    dates: list[float] = field(default_factory=list)  # one per pin: its next use
    next_use: float = 0.0  # the soonest of `dates`

    @property
    def pins(self) -> int:
        return len(self.dates)


class EvictionOrder(Generic[Ident]):
    def __init__(self, retention: str = "future_use") -> None:
        if retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {retention!r}")
        self.retention = retention
        self.evictable = 0
        self.pinned = 0  # entries with at least one pin
        self._entries: dict[Ident, _Entry] = {}
        self._classes: tuple[OrderedDict[Ident, None], ...] = tuple(OrderedDict() for _ in range(3))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ident: object) -> bool:
        return ident in self._entries

    def add(self, ident: Ident, size: int) -> None:
        """A new entry: undeclared, the most recently used."""
        if ident in self._entries:
            raise ValueError(f"{ident!r} is already ordered; remove it first")
        self._entries[ident] = _Entry(size)
        self._place(ident, _UNDECLARED)

    def remove(self, ident: Ident) -> None:
        entry = self._entries.pop(ident)
        self._unplace(ident, entry)
        self.pinned -= entry.pins > 0

    def touch(self, ident: Ident) -> None:
        """The entry was just used."""
        self._classes[self._entries[ident].cls].move_to_end(ident)

    def pin(self, ident: Ident, next_use: float | None = None) -> None:
        """One more pin: a family declares the entry's next use (None: now or any time)."""
        entry = self._entries[ident]
        self.pinned += entry.pins == 0
        entry.dates.append(_date(next_use))
        entry.next_use = min(entry.dates)
        self._move(ident, _DECLARED)

    def declare(self, ident: Ident, next_use: float, was: float | None = None) -> None:
        """A pin's new date: its family read the entry and will again at `next_use`; `was` is
        the date that pin held."""
        entry = self._entries[ident]
        if entry.pins:
            _take(entry.dates, _date(was))
            entry.dates.append(next_use)
            entry.next_use = min(entry.dates)
            self.touch(ident)

    def unpin(self, ident: Ident, was: float | None = None) -> None:
        """Take back a pin that held date `was`."""
        entry = self._entries[ident]
        if entry.pins == 0:
            raise ValueError(f"{ident!r} has no pin to take back")
        _take(entry.dates, _date(was))
        if entry.pins == 0:
            self.pinned -= 1
            entry.next_use = 0.0
            self._move(ident, _ENDED if self.retention == "future_use" else _UNDECLARED)
        else:
            entry.next_use = min(entry.dates)

    def victim(self) -> Ident | None:
        """The entry to evict next; None if no entry may be evicted."""
        for cls in (_ENDED, _UNDECLARED):
            if self._classes[cls]:
                return next(iter(self._classes[cls]))
        declared = self._classes[_DECLARED]
        if self.retention == "lru" or not declared:
            return None
        # reversed: the first of the furthest is the most recently used
        return max(reversed(declared), key=lambda i: self._entries[i].next_use)

    def _evicts(self, cls: int) -> bool:
        return cls != _DECLARED or self.retention == "future_use"

    def _move(self, ident: Ident, cls: int) -> None:
        self._unplace(ident, self._entries[ident])
        self._place(ident, cls)

    def _place(self, ident: Ident, cls: int) -> None:
        entry = self._entries[ident]
        entry.cls = cls
        self._classes[cls][ident] = None
        if self._evicts(cls):
            self.evictable += entry.size

    def _unplace(self, ident: Ident, entry: _Entry) -> None:
        del self._classes[entry.cls][ident]
        if self._evicts(entry.cls):
            self.evictable -= entry.size


def _date(next_use: float | None) -> float:
    return 0.0 if next_use is None else next_use


def _take(dates: list[float], date: float) -> None:
    """Remove one pin's date: `date`, or the furthest if no pin holds it (a caller that lost
    track cannot make an entry look sooner than its pins say)."""
    dates.remove(date if date in dates else max(dates))
