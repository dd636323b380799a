"""OpenAI's `logprobs` object of one choice, from the tokens and TokenLogprobs a backend returns.

- /v1/completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs" (per token: the k
  most likely and the chosen token, by text), "text_offset"}.
- /v1/chat/completions (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob",
  "bytes", "top_logprobs": [the k most likely, each {"token", "logprob", "bytes"}]}]}.

A token's text is the tokenizer's decoding of it alone, special tokens named (as vLLM's server
does: a character split over tokens shows as U+FFFD in each); `text_offset` counts the text the
choice shows (special tokens add none). A stream's chunks carry their own tokens' entries and the
offsets run on across them. Tokens after a stop string are not generated, but the one that
completed it is listed even where the text was cut inside it.
"""

from collections.abc import Sequence
from typing import Any

from kmesh.serve.backend import TokenLogprob


class LogprobsRenderer:
    def __init__(self, tokenizer: Any, is_chat: bool) -> None:
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        # Characters of the choice's text before the next token (completions' text_offset).
        self._offset = 0

    def render(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The logprobs object of these tokens, the next ones of the choice."""
        if self._is_chat:
            return {
                "content": [
                    self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)
                ]
            }
        offsets = []
        for token in token_ids:
            offsets.append(self._offset)
            self._offset += len(self._tokenizer.decode([token], skip_special_tokens=True))
        return {
            "tokens": [self._text(t) for t in token_ids],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {**{self._text(t): v for t, v in lp.top}, self._text(token): lp.logprob}
                for token, lp in zip(token_ids, logprobs, strict=True)
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, logprob: TokenLogprob) -> dict[str, Any]:
        return {
            **self._named(token, logprob.logprob),
            "top_logprobs": [self._named(t, v) for t, v in logprob.top],
        }

    def _named(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token: int) -> str:
        return str(self._tokenizer.decode([token], skip_special_tokens=False))
