"""One agent's chat request of `kmesh bench agents`, streamed and timed as a user sees it.

Time to first token: from sending the request to the first chunk that carries text (vLLM's
server sends the assistant role in a chunk of its own first; that chunk does not count). The
answer's text, its usage and KMesh's `kmesh` object (None from vLLM's own server) come back
with it; a non-200 status, a stream without its `[DONE]` or an error event is a failure.
"""

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class CallResult:
    status: int | None
    # None when served; else what went wrong, like "http 500: ..." or "transport: ReadTimeout".
    failure: str | None
    text: str
    first_token_s: float | None
    total_s: float
    # Unix time at which it was sent and at which its last byte came.
    sent_at: float
    done_at: float
    kmesh: dict[str, Any] | None


async def send_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> CallResult:
    """POST /v1/chat/completions with `body` (streamed) and read it to its end."""
    sent_at = time.time()
    started = time.perf_counter()
    pieces: list[str] = []
    first: float | None = None
    kmesh = None
    status: int | None = None
    failure: str | None = "bad_stream: no [DONE]"
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            status = response.status_code
            if status != 200:
                failure = f"http {status}: {(await response.aread()).decode()[:300]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        failure = None
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        failure = f"error event: {chunk['error']}"
                        break
                    kmesh = chunk.get("kmesh", kmesh)
                    for choice in chunk.get("choices", []):
                        text = choice.get("delta", {}).get("content") or ""
                        if text and first is None:
                            first = time.perf_counter() - started
                        pieces.append(text)
    except httpx.HTTPError as error:
        failure = f"transport: {type(error).__name__}"
    total = time.perf_counter() - started
    return CallResult(
        status, failure, "".join(pieces), first, total, sent_at, sent_at + total, kmesh
    )
