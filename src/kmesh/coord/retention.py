"""Bounded retention: ids kept in the order they came, the oldest retired past a limit.

What an engine remembers about ended or abandoned work (closed states, families nobody closed)
must not grow with every id a client ever sent. `Retention.add` keeps an id (a repeat moves it
to the newest place) and returns the ids it retired to stay within `limit`, oldest first; the
owner then forgets them. No tensors, no I/O.

Invariants: at most `limit` ids are held; retirement is in order of (last) arrival.
"""

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

Id = TypeVar("Id", bound=Hashable)


class Retention(Generic[Id]):
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a retention limit is at least 1, got {limit}")
        self.limit = limit
        self._ids: OrderedDict[Id, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def add(self, item: Id) -> list[Id]:
        """Keep `item` as the newest; returns the ids retired to make room, oldest first."""
        self._ids[item] = None
        self._ids.move_to_end(item)
        retired = []
        while len(self._ids) > self.limit:
            retired.append(self._ids.popitem(last=False)[0])
        return retired

    def discard(self, item: Id) -> None:
        self._ids.pop(item, None)
