"""Segments: a prompt as an ordered list of token runs, each with a role and an optional id.

This explicit metadata is the internal contract; the separator string and chat messages are two
encodings that produce it (see state/separator_codec.py and state/chat_codec.py).
"""

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kmesh.errors import ContractError


class Role(enum.Enum):
    SHARED = "shared"  # the same content appears in related requests (e.g. a round's outputs)
    PRIVATE = "private"  # this request's own content (its history, its persona)
    INSTRUCTION = "instruction"  # the request's closing ask


@dataclass(frozen=True, slots=True)
class Segment:
    token_ids: tuple[int, ...]
    role: Role = Role.PRIVATE
    # Caller-given identity: the same id must always mean the same tokens.
    segment_id: str | None = None
    # The caller's text this segment encodes (a chat message's content), when it came from text.
    text: str | None = None
    # The chat role ("system", "user", ...) when the segment encodes a chat message.
    message_role: str | None = None


@dataclass(frozen=True, slots=True)
class Span:
    """A segment given by position over a flat prompt: tokens [start, end)."""

    start: int
    end: int
    role: Role = Role.PRIVATE
    segment_id: str | None = None


def trunk_end(spans: Iterable[Span]) -> int:
    """Where a prompt's trunk ends: the end of its leading run of shared spans (0 when the
    first span is not shared). A family's trunk is what its members share from the start."""
    end = 0
    for span in spans:
        if span.role is not Role.SHARED:
            break
        end = span.end
    return end


@dataclass(frozen=True, slots=True)
class SegmentedPrompt:
    """A prompt whose token ids are its segments' concatenation. Construct with `of` or
    `from_spans`, which validate."""

    segments: tuple[Segment, ...]

    @classmethod
    def of(cls, segments: Iterable[Segment]) -> "SegmentedPrompt":
        prompt = cls(tuple(segments))
        if not prompt.segments:
            raise ContractError("a segmented prompt needs at least one segment")
        ids: dict[str, tuple[int, ...]] = {}
        for index, segment in enumerate(prompt.segments):
            if not segment.token_ids:
                raise ContractError(f"segment {index} ({segment.segment_id!r}) is empty")
            _check_segment_id(ids, segment)
        return prompt

    @classmethod
    def from_spans(cls, token_ids: Sequence[int], spans: Iterable[Span]) -> "SegmentedPrompt":
        """Segments from positions over `token_ids`. Spans must be in order, non-empty, within
        the prompt and non-overlapping; tokens no span covers become private segments."""
        segments: list[Segment] = []
        cursor = 0
        for span in spans:
            if not 0 <= span.start < span.end <= len(token_ids):
                raise ContractError(
                    f"span [{span.start}, {span.end}) is empty or outside the prompt "
                    f"of {len(token_ids)} tokens"
                )
            if span.start < cursor:
                raise ContractError(
                    f"span [{span.start}, {span.end}) overlaps the span before it (or is out of "
                    f"order): spans must be sorted and disjoint"
                )
            if span.start > cursor:
                segments.append(Segment(tuple(token_ids[cursor : span.start])))
            segments.append(
                Segment(tuple(token_ids[span.start : span.end]), span.role, span.segment_id)
            )
            cursor = span.end
        if cursor < len(token_ids):
            segments.append(Segment(tuple(token_ids[cursor:])))
        return cls.of(segments)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for segment in self.segments for t in segment.token_ids)

    @property
    def spans(self) -> tuple[Span, ...]:
        """Where each segment sits in the flat prompt."""
        spans = []
        start = 0
        for segment in self.segments:
            end = start + len(segment.token_ids)
            spans.append(Span(start, end, segment.role, segment.segment_id))
            start = end
        return tuple(spans)


def _check_segment_id(known: dict[str, tuple[int, ...]], segment: Segment) -> None:
    """Record a segment's id in `known`; refuse an id seen before with other tokens."""
    if segment.segment_id is None:
        return
    seen = known.setdefault(segment.segment_id, segment.token_ids)
    if seen != segment.token_ids:
        raise ContractError(
            f"segment id {segment.segment_id!r} is used for two different token sequences "
            f"({len(seen)} and {len(segment.token_ids)} tokens): give each content its own id"
        )
