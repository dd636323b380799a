"""Byte accounting of what recovery keeps, least recently used first: `hold` records an item and
names the items to drop to stay within the bound (never the one just held); `touch` marks a use.
No tensors: the owner drops what it is told.

What recovery keeps, one key type each: a stored segment (`HeldSegment`), a round's master
(`HeldMaster`), a kept prompt tail (`HeldTail`), a family's common context (`HeldCommon`)."""

from collections import OrderedDict
from dataclasses import dataclass

from kmesh.recovery.jobs import RoundKey


@dataclass(frozen=True, slots=True)
class HeldSegment:
    """A stored segment's KV (recovery/segment_store.py)."""

    tenant: str | None
    tokens: tuple[int, ...]
    context: str  # the segment index's context: FIRST_READER or AUTHOR


@dataclass(frozen=True, slots=True)
class HeldMaster:
    """A round's master (recovery/requests.py)."""

    round: RoundKey


@dataclass(frozen=True, slots=True)
class HeldTail:
    """A prompt's rows past a whole page (recovery/prefix_tails.py)."""

    tenant: str | None
    prefix: tuple[int, ...]  # every token before the tail's boundary


@dataclass(frozen=True, slots=True)
class HeldCommon:
    """A family's common context (recovery/common_master.py)."""

    tenant: str | None
    family: str


Held = HeldSegment | HeldMaster | HeldTail | HeldCommon


class Ledger:
    """Sizes of what is kept, least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self._sizes: OrderedDict[Held, int] = OrderedDict()

    def hold(self, key: Held, nbytes: int) -> list[Held]:
        """Record `key` (most recent) at `nbytes`; the keys to drop to stay within the bound."""
        self.total += nbytes - self._sizes.pop(key, 0)
        self._sizes[key] = nbytes
        dropped = []
        while self.total > self.max_bytes and len(self._sizes) > 1:
            old, size = self._sizes.popitem(last=False)
            self.total -= size
            dropped.append(old)
        return dropped

    def touch(self, key: Held) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)
