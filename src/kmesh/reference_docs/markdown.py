"""Markdown pieces the reference pages' generated blocks share."""

import re


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def sentence(text: str) -> str:
    """A help line as a sentence: a capital first letter (unless the first word is cased on
    its own, like "vLLM") and a full stop."""
    text = text.strip()
    if not text:
        return text
    first = re.split(r"[^A-Za-z]", text, maxsplit=1)[0]  # the first word's letters
    if not any(c.isupper() for c in first[1:]):
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else f"{text}."


def cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and outside code spans `<` and `*` too (markdown
    would read them as HTML and emphasis)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)
