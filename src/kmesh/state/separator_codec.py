"""The in-prompt separator encoding of segments (CacheBlend / TokenDance compatible).

A prompt "A # # B # # C" is three segments A, B, C; the separator itself is not part of any
segment. Each segment is tokenized on its own, as CacheBlend does, so the prompt's tokens are the
segments' concatenation.
"""

from collections.abc import Callable, Sequence

from kmesh.errors import ContractError
from kmesh.state.segments import Role, Segment, SegmentedPrompt

DEFAULT_SEPARATOR = " # # "

Tokenize = Callable[[str], list[int]]


def split_text(text: str, separator: str = DEFAULT_SEPARATOR) -> list[str]:
    """The segment texts of a separated prompt; empty segments are refused."""
    if not separator:
        raise ContractError("the segment separator must not be empty")
    parts = text.split(separator)
    for index, part in enumerate(parts):
        if not part:
            raise ContractError(
                f"segment {index} of the separated prompt is empty (two separators "
                f"{separator!r} in a row, or one at an end)"
            )
    return parts


def join_text(parts: Sequence[str], separator: str = DEFAULT_SEPARATOR) -> str:
    """The separated prompt of segment texts (the inverse of split_text)."""
    for index, part in enumerate(parts):
        if not part or separator in part:
            raise ContractError(f"segment {index} is empty or contains the separator {separator!r}")
    return separator.join(parts)


def decode(
    text: str,
    tokenize: Tokenize,
    separator: str = DEFAULT_SEPARATOR,
    roles: Sequence[Role] | None = None,
) -> SegmentedPrompt:
    """Segments of a separated prompt. Roles default to shared for every segment but the last,
    which is the instruction."""
    parts = split_text(text, separator)
    if roles is None:
        roles = [Role.SHARED] * (len(parts) - 1) + [Role.INSTRUCTION]
    if len(roles) != len(parts):
        raise ContractError(f"{len(roles)} roles given for {len(parts)} segments")
    return SegmentedPrompt.of(
        Segment(tuple(tokenize(part)), role, text=part)
        for part, role in zip(parts, roles, strict=True)
    )


def encode(prompt: SegmentedPrompt, separator: str = DEFAULT_SEPARATOR) -> str:
    """The separated prompt of segments that carry their text."""
    texts = []
    for index, segment in enumerate(prompt.segments):
        if segment.text is None:
            raise ContractError(f"segment {index} has no text to put in a separated prompt")
        texts.append(segment.text)
    return join_text(texts, separator)
