"""One HTTP exchange of `kmesh bench load`, sent and judged: its status against the exchange's
expectation, its text, and its timing (first token: the first content chunk of a stream, or the
whole answer; a stream must end with `data: [DONE]` unless the client leaves it early)."""

import json
import time
from dataclasses import dataclass

import httpx

from kmesh.workloads.serve_traffic import Exchange, encoded


@dataclass(slots=True)
class ExchangeResult:
    kind: str
    status: int | None
    failure: str | None
    first_token_s: float | None
    total_s: float
    text: str | None = None


async def send_exchange(client: httpx.AsyncClient, exchange: Exchange) -> ExchangeResult:
    """Send one exchange and judge it."""
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {exchange.key}", "Content-Type": "application/json"}
    streamed = isinstance(exchange.body, dict) and exchange.body.get("stream")
    first: float | None = None
    try:
        request = client.build_request(
            "POST", exchange.path, content=encoded(exchange), headers=headers
        )
        response = await client.send(request, stream=True)
        try:
            status = response.status_code
            if status != 200 or not streamed:
                payload = await response.aread()
                first = time.perf_counter() - started
                text = _whole_text(payload) if status == 200 else None
                failure = None
            else:
                text, failure, first = await _read_stream(response, exchange, started)
        finally:
            await response.aclose()
    except httpx.HTTPError as error:
        return ExchangeResult(
            exchange.kind,
            None,
            f"transport: {type(error).__name__}",
            None,
            time.perf_counter() - started,
        )
    total = time.perf_counter() - started
    if status >= 500:
        failure = "http_5xx"
    elif status not in exchange.expect:
        failure = "unexpected_status"
    return ExchangeResult(exchange.kind, status, failure, first, total, text)


async def _read_stream(
    response: httpx.Response, exchange: Exchange, started: float
) -> tuple[str | None, str | None, float | None]:
    """(text, failure, first-token seconds) of a stream read to its end, or closed early."""
    pieces: list[str] = []
    first: float | None = None
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return "".join(pieces), None, first
        chunk = json.loads(data)
        if "error" in chunk:
            return None, "http_5xx", first
        if first is None:
            first = time.perf_counter() - started
        pieces += [
            c.get("text") or c.get("delta", {}).get("content") or "" for c in chunk["choices"]
        ]
        chunks += 1
        if exchange.read_chunks is not None and chunks >= exchange.read_chunks:
            return None, None, first  # the client goes away
    return None, "bad_stream", first


def _whole_text(payload: bytes) -> str:
    body = json.loads(payload)
    texts = [c.get("text") if "text" in c else c["message"]["content"] for c in body["choices"]]
    return "\x1e".join(texts)
