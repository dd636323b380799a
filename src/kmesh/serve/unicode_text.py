"""Text that is not Unicode: the scan of a JSON body for lone surrogates.

JSON's \\u escapes can carry a lone surrogate ("\\ud800", half of a UTF-16 pair), which no
tokenizer, log or UTF-8 answer takes. `lone_surrogate` finds the first one in a body, keys
included, and says where; kmesh/serve/schema.py refuses such a body and kmesh/serve/errors.py
words the 400.
"""

import re
from dataclasses import dataclass
from typing import Any

# pydantic's error type for a string that is not Unicode text (it checks only constrained
# strings itself; schema.py's _Body checks them all, under the same type).
NOT_UNICODE = "string_unicode"
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class LoneSurrogate:
    """A string that is not Unicode text: where it is, and its first lone surrogate."""

    # Dotted, within the value searched ("": the value is that string); any surrogate in a key
    # is written as its escape, so the name can be printed and sent back.
    field: str
    # The surrogate's index in the string, and its code (0xD800 to 0xDFFF).
    index: int
    code: int


def lone_surrogate(value: Any, field: str = "") -> LoneSurrogate | None:
    """The first string in `value` (a JSON value: strings, lists, and dicts, keys included)
    that holds a lone surrogate; None if every one is Unicode text."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return None if match is None else LoneSurrogate(field, match.start(), ord(match[0]))
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, item in items:
        name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
        name = f"{field}.{name}" if field else name
        found = lone_surrogate(key, name) or lone_surrogate(item, name)
        if found is not None:
            return found
    return None
