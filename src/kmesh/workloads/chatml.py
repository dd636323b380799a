"""Prompts in ChatML, the embedded model's chat template, built by concatenating token ids.

Each piece is tokenized on its own, so a prompt's ids are the sum of its messages' ids and never
shift when a message is added (tests/workloads/test_allgather.py checks that whole prompts equal
the tokenizer's own template on the same messages).
"""

from typing import Any


class ChatML:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def tokens(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, content: str) -> tuple[int, ...]:
        return self.tokens(f"<|im_start|>{role}\n{content}<|im_end|>\n")

    def generation_prompt(self, role: str = "assistant") -> tuple[int, ...]:
        """The start of a reply by `role` (the template's generation prompt for "assistant")."""
        return self.tokens(f"<|im_start|>{role}\n")
