"""The requests `kmesh bench load` sends: a seeded mix of what a service sees.

Each kind is one HTTP exchange with an expectation. `exact` requests (greedy, no approximate
recovery) are kept for the cold check: the same body under a fresh cache_salt, so nothing is
reused, must give the same text. Kinds:

- plain: a completion over one of a few shared prefixes (prefix-cache hits between clients);
- chat: a chat completion, greedy;
- stream: a streamed completion read to `data: [DONE]`;
- disconnect: a long stream closed after a few chunks (the server must abort it);
- family: a declared family member (a shared trunk segment, a private suffix), n=2 branches;
- round: a declared round under an approximate salt (approximate: never checked), left open;
- bad_body: a body the server must refuse with a 4xx (never 5xx, never 200);
- bad_key: a request with a key the server does not know (401).
"""

import json
import random
from dataclasses import dataclass, field
from typing import Any

# The kinds any OpenAI server takes (no `kmesh` fields, no second tenant): the mix run against
# vanilla vLLM and against KMesh side by side (`kmesh bench load --mix plain`).
PLAIN_KINDS = ("plain", "chat", "stream", "disconnect")
KINDS = {  # kind -> weight in the mix
    "plain": 6,
    "chat": 3,
    "stream": 3,
    "disconnect": 2,
    "family": 2,
    "round": 2,
    "bad_body": 1,
    "bad_key": 1,
}
PREFIXES = tuple(
    f"Report {i} of the harbour office. The harbour keeps {10 + 3 * i} cranes, {4 + i} tugs and "
    f"a dry dock that takes ships of up to {120 + 15 * i} metres. This season the office counted "
    f"{300 + 37 * i} arrivals, most of them grain and timber, and {i + 2} collisions, none "
    "serious. The pilots ask for a second radar mast and longer shifts in the winter. "
    for i in range(6)
)
QUESTIONS = (
    "What should the office buy first?",
    "Summarise the report in one sentence.",
    "Which number in the report is the largest?",
    "What do the pilots want?",
    "Is the harbour busy?",
)
BAD_BODIES: tuple[Any, ...] = (
    "{not json",
    [],
    {"prompt": "x", "max_tokens": -3},
    {"prompt": "x", "temperature": "hot"},
    {"messages": "hello"},
    {"prompt": "x", "n": 10_000},
    {"prompt": "x", "kmesh": {"segments": []}},
    {"prompt": "x", "kmesh": {"recovery": {"policy": "guess"}}},
    {"prompt": "x", "logprobs": 1000},
    {"prompt": ["a", "b"], "stop": ["1", "2", "3", "4", "5"]},
)


@dataclass(frozen=True, slots=True)
class Exchange:
    kind: str
    path: str  # /v1/completions or /v1/chat/completions
    body: Any  # a JSON value (or, for a bad body, raw text)
    key: str
    # Greedy and served exactly: its text is checked against a cold run.
    exact: bool = False
    # disconnect: close the stream after this many chunks.
    read_chunks: int | None = None
    # The HTTP statuses this exchange may get (anything else is a failure).
    expect: tuple[int, ...] = (200,)
    options: dict[str, Any] = field(default_factory=dict)


def next_exchange(
    rng: random.Random, keys: tuple[str, ...], serial: int, kinds: tuple[str, ...] = tuple(KINDS)
) -> Exchange:
    """One exchange of the mix of `kinds` (at their weights); `serial` makes ids (families,
    rounds) unique."""
    kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
    key = keys[rng.randrange(len(keys))]
    prefix, question = rng.choice(PREFIXES), rng.choice(QUESTIONS)
    greedy = {"temperature": 0, "max_tokens": rng.randint(4, 24)}
    completion = {"prompt": f"{prefix}Question: {question} Answer:", **greedy}
    if kind == "plain":
        return Exchange(kind, "/v1/completions", completion, key, exact=True)
    if kind == "chat":
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        return Exchange(kind, "/v1/chat/completions", {"messages": messages, **greedy}, key, True)
    if kind == "stream":
        return Exchange(kind, "/v1/completions", {**completion, "stream": True}, key, True)
    if kind == "disconnect":
        body = {**completion, "max_tokens": 400, "ignore_eos": True, "stream": True}
        return Exchange(kind, "/v1/completions", body, key, read_chunks=rng.randint(1, 6))
    if kind == "family":
        segments = [
            {"text": prefix, "role": "shared", "id": f"harbour-{PREFIXES.index(prefix)}"},
            {"text": f"Question: {question} Answer:"},
        ]
        kmesh = {"family": f"load-{serial}", "branches": 2, "segments": segments}
        body = {"prompt": "", "kmesh": kmesh, "n": 2, **greedy}
        return Exchange(kind, "/v1/completions", body, key, exact=True)
    if kind == "round":
        return Exchange(kind, "/v1/completions", round_member(rng, serial), key)
    if kind == "bad_body":
        bad = rng.choice(BAD_BODIES)
        return Exchange(kind, "/v1/completions", bad, key, expect=(400, 422))
    return Exchange(kind, "/v1/completions", completion, "not-a-key-of-this-server", expect=(401,))


def round_member(rng: random.Random, serial: int) -> dict[str, Any]:
    """A member of a two-output round of its own (opened, never closed)."""
    outputs = [(f"out-{serial}-{i}", f" Member {i} says: buy the radar mast.") for i in range(2)]
    order = [name for name, _ in outputs]
    rng.shuffle(outputs)
    segments = [
        {"text": PREFIXES[0], "role": "shared", "id": "system"},
        *({"text": text, "role": "shared", "id": name} for name, text in outputs),
        {"text": " Your vote:", "role": "instruction"},
    ]
    recovery = {"policy": "kv_deviation", "round": {"id": f"r-{serial}", "segments": order}}
    kmesh = {"family": f"council-{serial}", "segments": segments, "recovery": recovery}
    return {
        "prompt": "",
        "kmesh": kmesh,
        "cache_salt": "kmesh-approx:load",
        "temperature": 0,
        "max_tokens": 4,
    }


def encoded(exchange: Exchange) -> bytes:
    body = exchange.body
    return body.encode() if isinstance(body, str) else json.dumps(body).encode()
