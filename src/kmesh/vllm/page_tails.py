"""Rows below vLLM's page: which last, partly used pages of earlier requests the worker keeps.

vLLM's prefix cache hits whole pages, and never the page holding a prompt's last token. So every
branch of a fork recomputes the fork point's last page, and a continuation of a finished request
(a chain-of-thought trunk, a tree's node, a chat's next turn) recomputes the rows its parent
computed after its last whole page. The connector keeps those rows. Each kept tail is the rows
[start, end) of one page, where start is a page start and end - 1 the last row written there,
when a request's prompt is computed and when it finishes. A later request whose claim starts at
`start`, under the same anchor, takes rows [start, e) from the tail that shares the most tokens
with it there. e stops before its prompt's last token, which vLLM computes. The same tokens at
the same positions after the same prefix give the same rows.

This index holds no tensors: it says which tails the worker half holds (worker_side.py keeps,
copies and drops the rows), and evicts the least recently used past its byte budget.

Invariants:
- A tail is filed under its anchor: the chained key of the whole pages before `start`, which
  names model, adapter and cache_salt. A tail therefore never crosses tenants or adapters.
- A hit compares every token before e.
- Each anchor holds no tail whose tokens another tail there continues: a longer tail replaces
  the one it extends, and a tail some kept one already covers is not filed again.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kmesh.state.keys import BlockHash

# What the worker keeps of tails at most, in bytes (a float32 page of the embedded model is
# 1.4 MiB: about 45 pages).
DEFAULT_TAIL_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Tail:
    tail_id: int
    anchor: BlockHash
    start: int  # a page start
    token_ids: tuple[int, ...]  # every token before the tail's end


@dataclass(frozen=True, slots=True)
class TailHit:
    tail_id: int
    start: int
    end: int  # rows [start, end) come from the tail


class PageTails:
    def __init__(self, row_bytes: int, budget_bytes: int = DEFAULT_TAIL_BYTES) -> None:
        self.row_bytes = row_bytes
        self.budget_bytes = budget_bytes
        self._tails: OrderedDict[int, Tail] = OrderedDict()  # least recently used first
        self._by_anchor: dict[BlockHash, list[int]] = {}
        self._bytes = 0
        self._next_id = 0
        self._dropped: list[int] = []

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def find(
        self, anchor: BlockHash, token_ids: Sequence[int], start: int, end: int
    ) -> TailHit | None:
        """The kept tail under `anchor` at `start` that shares the most of `token_ids`'s rows
        [start, end) (every token before each row equal), or None when none shares a row."""
        best: TailHit | None = None
        for tail_id in self._by_anchor.get(anchor, ()):
            tail = self._tails[tail_id]
            if tail.start != start or tuple(token_ids[:start]) != tail.token_ids[:start]:
                continue
            shared = start
            stop = min(end, len(tail.token_ids))
            while shared < stop and token_ids[shared] == tail.token_ids[shared]:
                shared += 1
            if shared > start and (best is None or shared > best.end):
                best = TailHit(tail_id, start, shared)
        if best is not None:
            self._tails.move_to_end(best.tail_id)
        return best

    def file(self, anchor: BlockHash, start: int, token_ids: Sequence[int]) -> int | None:
        """File the rows [start, len(token_ids)) as a new tail: its id, for the worker to keep
        them under. None when a kept tail already holds them (it counts as used) or they do not
        fit the budget."""
        tokens = tuple(token_ids)
        rows = len(tokens) - start
        if rows <= 0 or rows * self.row_bytes > self.budget_bytes:
            return None
        ids = self._by_anchor.setdefault(anchor, [])
        for tail_id in list(ids):
            held = self._tails[tail_id]
            if held.start != start:
                continue
            if held.token_ids[: len(tokens)] == tokens:
                self._tails.move_to_end(tail_id)
                return None
            if tokens[: len(held.token_ids)] == held.token_ids:
                self.drop(tail_id)
        tail = Tail(self._next_id, anchor, start, tokens)
        self._next_id += 1
        self._tails[tail.tail_id] = tail
        self._by_anchor.setdefault(anchor, []).append(tail.tail_id)
        self._bytes += rows * self.row_bytes
        while self._bytes > self.budget_bytes:
            self.drop(next(iter(self._tails)))
        return tail.tail_id

    def clear(self) -> None:
        """Drop every tail."""
        for tail_id in list(self._tails):
            self.drop(tail_id)

    def take_dropped(self) -> list[int]:
        """The tails dropped since the last call (the worker frees their rows)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def drop(self, tail_id: int) -> None:
        """Forget a tail (the worker frees its rows); no-op for one already gone."""
        tail = self._tails.pop(tail_id, None)
        if tail is None:
            return
        ids = self._by_anchor[tail.anchor]
        ids.remove(tail_id)
        if not ids:
            del self._by_anchor[tail.anchor]
        self._bytes -= (len(tail.token_ids) - tail.start) * self.row_bytes
        self._dropped.append(tail_id)
