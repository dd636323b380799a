"""Text of a growing output, handed out piece by piece without splitting a character."""

from collections.abc import Iterable
from typing import Any

# What the tokenizer decodes an incomplete UTF-8 sequence to.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Decodes all tokens so far each time and hands out the new suffix of the text.

    A character split across tokens (an emoji, most CJK) decodes to U+FFFD until its last byte
    arrives, so the text is held back while it ends with one. Special tokens (end of sequence)
    are skipped. The pieces concatenate to the text of all tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._sent = ""

    def add(self, token_ids: Iterable[int]) -> None:
        self._token_ids.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def take_complete(self) -> str:
        """Text not handed out yet, up to the last complete character."""
        text = self._decode()
        return "" if text.endswith(REPLACEMENT_CHAR) else self._take(text)

    def take_rest(self) -> str:
        """All text not handed out yet (the output has ended)."""
        return self._take(self._decode())

    def _take(self, text: str) -> str:
        # NOTE: this relies on the text of a token list starting with the text of its prefix,
        # true of byte-level BPE and SentencePiece tokenizers.
        new = text[len(self._sent) :]
        self._sent = text
        return new

    def _decode(self) -> str:
        return str(self._tokenizer.decode(self._token_ids, skip_special_tokens=True))
