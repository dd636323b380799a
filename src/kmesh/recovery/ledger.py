"""Byte accounting of what recovery keeps (stored segments, masters, common contexts), least
recently used first: `hold` records an item and names the items to drop to stay within the bound
(never the one just held); `touch` marks a use. No tensors: the owner drops what it is told."""

from collections import OrderedDict
from typing import Any


class Ledger:
    """Sizes of what is kept, least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self._sizes: OrderedDict[tuple[Any, ...], int] = OrderedDict()

    def hold(self, key: tuple[Any, ...], nbytes: int) -> list[tuple[Any, ...]]:
        """Record `key` (most recent) at `nbytes`; the keys to drop to stay within the bound."""
        self.total += nbytes - self._sizes.pop(key, 0)
        self._sizes[key] = nbytes
        dropped = []
        while self.total > self.max_bytes and len(self._sizes) > 1:
            old, size = self._sizes.popitem(last=False)
            self.total -= size
            dropped.append(old)
        return dropped

    def touch(self, key: tuple[Any, ...]) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)
