"""Prompts in ChatML, the embedded model's chat template, built by concatenating token ids.

Each piece is tokenized on its own, so a prompt's ids are the sum of its messages' ids and never
shift when a message is added (tests/workloads/test_allgather.py checks that whole prompts equal
the tokenizer's own template on the same messages).
"""

from collections.abc import Sequence
from typing import Any

from kmesh.state.segments import Role, Segment


class ChatML:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def tokens(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, content: str) -> tuple[int, ...]:
        return self.tokens(f"<|im_start|>{role}\n{content}<|im_end|>\n")

    def message_segment(self, role: str, content: str, kind: Role, segment_id: str) -> Segment:
        """A message as a prompt's segment of the given kind, carrying its content and role."""
        return Segment(self.message(role, content), kind, segment_id, content, role)

    def opening_segment(self, role: str, content: str, kind: Role, segment_id: str) -> Segment:
        """A prompt's first message as its segment: after the tokenizer's own start tokens (BOS,
        for a tokenizer that adds one; none for the embedded model's), as a prompt starts."""
        start = tuple(self._tokenizer("", add_special_tokens=True)["input_ids"])
        return Segment(start + self.message(role, content), kind, segment_id, content, role)

    def instruction_segment(self, content: str, segment_id: str) -> Segment:
        """A user's instruction closing a prompt, with the generation prompt after it."""
        tokens = self.message("user", content) + self.generation_prompt()
        return Segment(tokens, Role.INSTRUCTION, segment_id, content, "user")

    def generation_prompt(self, role: str = "assistant") -> tuple[int, ...]:
        """The start of a reply by `role` (the template's generation prompt for "assistant")."""
        return self.tokens(f"<|im_start|>{role}\n")

    def decode(self, output_ids: Sequence[int]) -> str:
        """Generated tokens as text: special tokens dropped, white space stripped at both ends."""
        return self._tokenizer.decode(list(output_ids), skip_special_tokens=True).strip()

    def closed(self, output_ids: tuple[int, ...]) -> tuple[int, ...]:
        """A reply's exact tokens, closed like a message (<|im_end|>) if generation was cut
        short."""
        ended = bool(output_ids) and output_ids[-1] == self._end_id
        return output_ids if ended else (*output_ids, self._end_id)
