"""Round-aware segment index: position-independent segments keyed by content and context.

A segment's KV is useful at any offset once its keys are stored at canonical positions (0..n-1 of
the segment, see kv/segment_kv.py), but it is only as good as the context it was computed in: the
same output read after its author's prompt, or after a round's common context, has different KV.
So an entry's key is (namespace, tokens, context tag), and a lookup names the context it accepts.
Entries carry the round that produced them, so a finished round's state can be dropped at once.

Holds no tensors (the value is opaque); a hit compares the stored tokens, so a hash collision can
never serve another segment's state.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kmesh.state.keys import KeyNamespace, segment_key

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IndexedSegment(Generic[T]):
    token_ids: tuple[int, ...]
    context: str
    round: int
    value: T


class SegmentIndex(Generic[T]):
    """Segments of one namespace (model, adapter, tenant): state never crosses namespaces."""

    def __init__(self, namespace: KeyNamespace) -> None:
        self.namespace = namespace
        self._entries: dict[bytes, IndexedSegment[T]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, token_ids: Sequence[int], context: str, round_index: int, value: T) -> None:
        """Index a segment's state; a later put of the same segment and context replaces it."""
        if not token_ids:
            raise ValueError("an indexed segment needs at least one token")
        tokens = tuple(token_ids)
        key = segment_key(self.namespace, tokens, context)
        self._entries[key] = IndexedSegment(tokens, context, round_index, value)

    def get(self, token_ids: Sequence[int], context: str) -> T | None:
        """The state of exactly these tokens computed in `context`, or None."""
        tokens = tuple(token_ids)
        entry = self._entries.get(segment_key(self.namespace, tokens, context))
        if entry is None or entry.token_ids != tokens:
            return None
        return entry.value

    def discard(self, token_ids: Sequence[int], context: str) -> bool:
        """Forget one segment's state; whether it was held."""
        key = segment_key(self.namespace, tuple(token_ids), context)
        return self._entries.pop(key, None) is not None

    def drop_rounds_before(self, round_index: int) -> int:
        """Forget every segment produced before `round_index`; returns how many were dropped."""
        stale = [key for key, entry in self._entries.items() if entry.round < round_index]
        for key in stale:
            del self._entries[key]
        return len(stale)
