"""The chat-message encoding of segments: one segment per message.

Each message's segment is the text its chat template adds for it (the template's wrapper around the
content, plus a default system prompt where the template inserts one), tokenized on its own; the
generation prompt, when asked for, is a final instruction segment. A message may carry "id" (the
segment id) and "kmesh_role" (shared / private / instruction); by default system messages are
shared and the others private. Its "name" (OpenAI's speaker name) is rendered as the template
renders it, so the segments spell the prompt the same chat has without them; `encode` does not
give it back.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kmesh.errors import ContractError
from kmesh.state.segments import Role, Segment, SegmentedPrompt

# (messages, add_generation_prompt) -> the templated prompt text
Render = Callable[[list[dict[str, str]], bool], str]
Tokenize = Callable[[str], list[int]]

_DEFAULT_ROLES = {"system": Role.SHARED}


def _role_of(message: Mapping[str, Any], index: int) -> Role:
    given = message.get("kmesh_role")
    if given is None:
        return _DEFAULT_ROLES.get(message["role"], Role.PRIVATE)
    try:
        return Role(given)
    except ValueError:
        raise ContractError(
            f"message {index} has kmesh_role {given!r}; use one of {[role.value for role in Role]}"
        ) from None


def decode(
    messages: Sequence[Mapping[str, Any]],
    render: Render,
    tokenize: Tokenize,
    add_generation_prompt: bool = True,
) -> SegmentedPrompt:
    """Segments of a chat, one per message (plus the generation prompt)."""
    if not messages:
        raise ContractError("a chat needs at least one message")
    plain: list[dict[str, str]] = []
    segments = []
    rendered = ""
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ContractError(f"message {index} needs a string 'role' and a string 'content'")
        name = message.get("name")  # a speaker's name, where the template renders one
        plain.append(
            {"role": message["role"], "content": message["content"]}
            | ({} if name is None else {"name": name})
        )
        longer = render(plain, False)
        if not longer.startswith(rendered):
            raise ContractError(
                "the chat template does not render messages incrementally (message "
                f"{index} changes the text before it), so messages cannot be segments"
            )
        segments.append(
            Segment(
                tuple(tokenize(longer[len(rendered) :])),
                _role_of(message, index),
                message.get("id"),
                text=message["content"],
                message_role=message["role"],
            )
        )
        rendered = longer
    if add_generation_prompt:
        tail = render(plain, True)[len(rendered) :]
        if tail:
            segments.append(Segment(tuple(tokenize(tail)), Role.INSTRUCTION))
    return SegmentedPrompt.of(segments)


def encode(prompt: SegmentedPrompt) -> list[dict[str, str]]:
    """The messages a chat-decoded prompt came from (the generation prompt is not a message)."""
    messages = []
    for segment in prompt.segments:
        if segment.message_role is None:
            continue
        message = {
            "role": segment.message_role,
            "content": segment.text or "",
            "kmesh_role": segment.role.value,
        }
        if segment.segment_id is not None:
            message["id"] = segment.segment_id
        messages.append(message)
    return messages
