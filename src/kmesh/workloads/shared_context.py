"""One shared context read by N agents, each with its own adapter and question.

The context is a system message of notes the embedded model wrote itself (greedy reports on fixed
topics, generated with the reference engine, so it is deterministic in the model and the seed),
cut to exactly `context_tokens` tokens including the chat header and end marker, and cached in
cache_dir()/workloads/ by (model fingerprint, seed, length, recipe version). Agent i then
asks its own question as a user message, followed by
- for a plain adapter, the assistant's generation prompt;
- for an activated adapter, its invocation sequence (the adapter applies from there on).
Everything is token ids: prompts are built by concatenation, never retokenized.
"""

import json
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kmesh.compute.embedded import cache_dir
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.errors import InvalidRequestError
from kmesh.workloads.chatml import ChatML

TOPICS = (
    "the water supply of a small town",
    "how bees build their hives",
    "the history of the bicycle",
    "why the sky is blue",
    "how to plan a vegetable garden",
    "the rules of a card game",
    "the life of a lighthouse keeper",
    "how bread is baked",
    "the planets of the solar system",
    "a walk through an old city",
    "how a library is organised",
    "the migration of birds",
    "how trains are scheduled",
    "the care of a pet dog",
    "how rain forms",
    "the work of a town council",
)
QUESTIONS = (
    "What is the most important point in these notes?",
    "Summarise the notes in two sentences.",
    "Which topic in the notes would you explain to a child first, and how?",
    "What question would you ask the author of these notes?",
    "Name one thing in the notes that surprised you.",
    "Which part of the notes is the least clear?",
    "Give the notes a title.",
    "What would you add to these notes?",
    "Which topic do the notes cover best?",
    "Write one sentence of advice based on the notes.",
    "What is a common thread between two of the topics?",
    "Which fact from the notes would you check first?",
    "Turn one of the notes into a short question for a quiz.",
    "Who would find these notes most useful?",
    "What is missing from the notes about trains?",
    "Describe the tone of the notes.",
)
REPORT_TOKENS = 160
_VERSION = "shared-context-v1"


def shared_context(
    engine: Engine, tokenizer: Any, context_tokens: int, seed: int = 0
) -> tuple[int, ...]:
    """The notes as a system message of exactly `context_tokens` tokens (cached)."""
    cached = (
        cache_dir()
        / "workloads"
        / f"{_VERSION}-{engine.kv.model_fingerprint[:16]}-{seed}-{context_tokens}.json"
    )
    if cached.is_file():
        return tuple(json.loads(cached.read_text()))
    tokens = _write_notes(engine, tokenizer, context_tokens, seed)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cached.parent, delete=False) as staging:
        json.dump(list(tokens), staging)
    Path(staging.name).replace(cached)  # atomic: readers see a whole file or none
    return tokens


def _write_notes(engine: Engine, tokenizer: Any, context_tokens: int, seed: int) -> tuple[int, ...]:
    chat = ChatML(tokenizer)
    head = chat.tokens("<|im_start|>system\nShared notes:\n")
    tail = chat.tokens("<|im_end|>\n")
    body_tokens = context_tokens - len(head) - len(tail)
    if body_tokens < 1:
        raise InvalidRequestError(
            f"context_tokens must exceed the chat header ({len(head) + len(tail)} tokens), "
            f"got {context_tokens}"
        )
    topics = list(TOPICS)
    random.Random(seed).shuffle(topics)
    needed = min(len(topics), -(-body_tokens // (REPORT_TOKENS // 2)))
    params = SamplingParams(max_tokens=REPORT_TOKENS)
    requests = [
        Request(
            f"notes-{i}",
            chat.message("user", f"Write a short report on {topic}.") + chat.generation_prompt(),
            params,
        )
        for i, topic in enumerate(topics[:needed])
    ]
    body: tuple[int, ...] = ()
    for i, out in enumerate(engine.generate(requests)):
        body += chat.tokens(f"Report {i + 1}: {chat.decode(out.output_ids)}\n")
    if len(body) < body_tokens:
        raise InvalidRequestError(
            f"the notes hold {len(body)} tokens, fewer than the {body_tokens} asked for: "
            "lower context_tokens"
        )
    return head + body[:body_tokens] + tail


def agent_tokens(tokenizer: Any, agent: int, invocation: Sequence[int] | None) -> tuple[int, ...]:
    """Agent `agent`'s question, then the generation prompt (plain) or its invocation."""
    chat = ChatML(tokenizer)
    question = chat.message("user", QUESTIONS[agent % len(QUESTIONS)])
    ending = chat.generation_prompt() if invocation is None else tuple(invocation)
    return question + ending
