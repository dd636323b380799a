"""Round-aware segment index: position-independent segments keyed by content and context.

A segment's KV is useful at any offset once its keys are stored at canonical positions (0..n-1 of
the segment, see kv/segment_kv.py), but it is only as good as the context it was computed in: the
same output read after its author's prompt, or after a round's common context, has different KV.
So an entry's key is (namespace, tokens, context tag), and a lookup names the context it accepts
(AUTHOR: an output's KV as its author generated it; FIRST_READER: a segment's KV computed in full
by the first request that read it). `find_within` finds an entry whose tokens occur inside a longer
segment (an output inside the header and closing a reader's prompt wraps it in). Entries carry the
round that produced them, so a finished round's state can be dropped at once.

Holds no tensors (the value is opaque); a hit compares the stored tokens, so a hash collision can
never serve another segment's state.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kmesh.state.keys import KeyNamespace, segment_key

T = TypeVar("T")

AUTHOR = "author"
FIRST_READER = "first-reader"
# find_within looks entries up by their first tokens; shorter entries are never found inside.
ANCHOR_TOKENS = 4


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
        # (context, first ANCHOR_TOKENS tokens) -> keys of the entries that start with them
        self._anchors: dict[tuple[str, tuple[int, ...]], set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, token_ids: Sequence[int], context: str, round_index: int, value: T) -> None:
        """Index a segment's state; a later put of the same segment and context replaces it."""
        if not token_ids:
            raise ValueError("an indexed segment needs at least one token")
        tokens = tuple(token_ids)
        key = segment_key(self.namespace, tokens, context)
        self._entries[key] = IndexedSegment(tokens, context, round_index, value)
        if len(tokens) >= ANCHOR_TOKENS:
            self._anchors.setdefault((context, tokens[:ANCHOR_TOKENS]), set()).add(key)

    def get(self, token_ids: Sequence[int], context: str) -> T | None:
        """The state of exactly these tokens computed in `context`, or None."""
        tokens = tuple(token_ids)
        entry = self._entries.get(segment_key(self.namespace, tokens, context))
        if entry is None or entry.token_ids != tokens:
            return None
        return entry.value

    def find_within(
        self, token_ids: Sequence[int], context: str
    ) -> tuple[int, IndexedSegment[T]] | None:
        """The longest entry of `context` (at least ANCHOR_TOKENS long) whose tokens occur inside
        `token_ids`, with its offset there (the first occurrence), or None."""
        tokens = tuple(token_ids)
        best: tuple[int, IndexedSegment[T]] | None = None
        for offset in range(len(tokens) - ANCHOR_TOKENS + 1):
            for key in self._anchors.get((context, tokens[offset : offset + ANCHOR_TOKENS]), ()):
                entry = self._entries[key]
                n = len(entry.token_ids)
                if tokens[offset : offset + n] == entry.token_ids and (
                    best is None or n > len(best[1].token_ids)
                ):
                    best = (offset, entry)
        return best

    def discard(self, token_ids: Sequence[int], context: str) -> bool:
        """Forget one segment's state; whether it was held."""
        key = segment_key(self.namespace, tuple(token_ids), context)
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._unanchor(key, entry)
        return entry is not None

    def drop_rounds_before(self, round_index: int) -> int:
        """Forget every segment produced before `round_index`; returns how many were dropped."""
        stale = [key for key, entry in self._entries.items() if entry.round < round_index]
        for key in stale:
            self._unanchor(key, self._entries.pop(key))
        return len(stale)

    def _unanchor(self, key: bytes, entry: IndexedSegment[T]) -> None:
        anchor = (entry.context, entry.token_ids[:ANCHOR_TOKENS])
        keys = self._anchors.get(anchor)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._anchors[anchor]


class TenantIndexes(Generic[T]):
    """One SegmentIndex per tenant of a model (no adapter), made on first use."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._indexes: dict[str | None, SegmentIndex[T]] = {}

    def __call__(self, tenant: str | None) -> SegmentIndex[T]:
        index = self._indexes.get(tenant)
        if index is None:
            index = SegmentIndex(KeyNamespace(self.fingerprint, None, tenant))
            self._indexes[tenant] = index
        return index
