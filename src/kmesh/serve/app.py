"""The HTTP side of `kmesh serve`: OpenAI's /v1/models, /v1/completions, /v1/chat/completions,
vLLM's /tokenize and /detokenize (kmesh/serve/tokens.py), Prometheus's /metrics
(kmesh/serve/metrics.py), and GET /health: 200 while the engine serves, 503 once it failed (then
every generation request gets 503 too, with what failed; a restart is needed). With API keys
(kmesh/state/tenants.py), every route but /health and /metrics needs a valid bearer key (401
without), and a request's state is its key's tenant's only.

Every response carries a top-level `kmesh` object (a stream: on its last content chunk; with
n > 1, counts summed over the choices):
prompt_tokens, computed_tokens, reused_tokens (local prefix cache), restored_tokens (external
store), family and engine. A stream carries usage only when `stream_options.include_usage` asks,
in OpenAI's shape: a last chunk with no choices, before `data: [DONE]`. A request whose client
disconnects is aborted in the engine, streamed or not (a non-streamed one within
DISCONNECT_POLL_S; logged and counted with status 499).

Errors are answered in OpenAI's shape (kmesh/serve/errors.py): 400 for a caller's mistake, with a
message that says what to change; 500 for anything unexpected, its traceback in the server's log
only. Fields the server does not know
are ignored and logged, as vLLM's server does (`strict_fields`: refused with a 400). Each request
gets one line in the `kmesh.serve.access` log: status, then tokens and reuse, or the error; and
is counted in /metrics.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kmesh.serve.backend import Backend, Delta, EngineStoppedError, GenerationJob
from kmesh.serve.branches import ChoiceText, Piece, run_choices
from kmesh.serve.errors import INTERNAL_ERROR, add_error_handlers, route_of
from kmesh.serve.jobs import chat_job, completion_job
from kmesh.serve.metrics import CONTENT_TYPE, ServeMetrics
from kmesh.serve.output_limit import check_max_tokens
from kmesh.serve.request_fields import RequestFieldError
from kmesh.serve.schema import (
    CHAT,
    COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    ResponseBuilder,
    ResponseShape,
    TokenizeRequest,
    error_body,
    unknown_fields,
    usage,
)
from kmesh.serve.tokens import detokenize, tokenize
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.tenants import ApiKeys, tenant_salt

logger = logging.getLogger(__name__)
access = logging.getLogger("kmesh.serve.access")
# How often a non-streamed request checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.5

# Stats summed over a request's choices (n > 1).
_SUMMED = (
    "prompt_tokens",
    "computed_tokens",
    "reused_tokens",
    "restored_tokens",
    "recovered_tokens",
)
# The counts in a served request's access line.
_LOGGED = (
    "prompt_tokens",
    "completion_tokens",
    "computed_tokens",
    "reused_tokens",
    "restored_tokens",
    "recovered_tokens",
)


def create_app(
    backend: Backend,
    on_ready: Callable[[], None] | None = None,
    strict_fields: bool = False,
    reuse_messages: RecoverySpec | None = None,
    api_keys: ApiKeys | None = None,
) -> FastAPI:
    """The server's app; it starts the backend on startup (then calls `on_ready`) and closes
    it on shutdown. `strict_fields`: refuse unknown fields instead of ignoring them.
    `reuse_messages`: the recovery of chat messages without declarations, under approximate
    salts only (None: no such reuse; kmesh/serve/jobs.py::chat_job). `api_keys`: the keys
    requests must carry, each a tenant's (None: no keys, one shared namespace)."""

    def tenant(request: Request) -> str | None:
        """The request's tenant (None without keys); raises AuthenticationError."""
        if api_keys is None:
            return None
        return api_keys.tenant(request.headers.get("authorization"))

    authenticated = [Depends(tenant)]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="kmesh serve", lifespan=lifespan)
    app.state.metrics = ServeMetrics(backend.load)
    add_error_handlers(app)

    @app.get("/v1/models", dependencies=authenticated)
    async def models() -> dict[str, Any]:
        model = {"id": backend.model_id, "object": "model", "created": 0, "owned_by": "kmesh"}
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = backend.failure()
        if failure is not None:
            return JSONResponse({"status": "failed", "error": failure}, status_code=503)
        load = backend.load()
        return JSONResponse(
            {
                "status": "ready",
                "engine": backend.engine,
                "running": load.running,
                "waiting": load.waiting,
                "kv_usage": load.kv_usage,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=authenticated)
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        _unknown(body, strict_fields)
        return tokenize(body, backend)

    @app.post("/detokenize", dependencies=authenticated)
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        _unknown(body, strict_fields)
        return detokenize(body, backend)

    async def generate(
        request: Request,
        body: GenerationRequest,
        shape: ResponseShape,
        make_job: Callable[[], GenerationJob],
        tenant: str | None,
    ) -> Response:
        """A generation route's answer: the body checked, then the job `make_job` builds from
        it (under the tenant's salt) run and answered in `shape`."""
        _unknown(body, strict_fields)
        check_max_tokens(body, backend.max_model_len)
        return await _respond(backend, _of_tenant(make_job(), tenant), shape, body, request)

    @app.post("/v1/completions")
    async def completions(
        request: Request, body: CompletionRequest, tenant: str | None = Depends(tenant)
    ) -> Response:
        return await generate(
            request, body, COMPLETION, lambda: completion_job(body, backend), tenant
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(
        request: Request, body: ChatCompletionRequest, tenant: str | None = Depends(tenant)
    ) -> Response:
        return await generate(
            request, body, CHAT, lambda: chat_job(body, backend, reuse_messages), tenant
        )

    return app


def _unknown(body: BaseModel, strict: bool) -> None:
    """Refuse (strict) or log the body's fields this server does not know."""
    fields = unknown_fields(body)
    if not fields:
        return
    if strict:
        known = ", ".join(type(body).model_fields)
        raise RequestFieldError(
            f"{fields[0]}: unknown field: remove it (top-level fields: {known})", fields[0]
        )
    logger.info("ignored fields this server does not know: %s", ", ".join(fields))


def _of_tenant(job: GenerationJob, tenant: str | None) -> GenerationJob:
    return job if tenant is None else replace(job, cache_salt=tenant_salt(tenant, job.cache_salt))


async def _respond(
    backend: Backend,
    job: GenerationJob,
    shape: ResponseShape,
    body: GenerationRequest,
    request: Request,
) -> Response:
    route, metrics = route_of(request), request.app.state.metrics
    builder = ResponseBuilder.new(shape, backend.model_id)
    started = time.perf_counter()
    if body.stream:
        deltas = backend.branches(job, body.n)
        # Errors before the first token (the engine refusing the job) are still HTTP errors.
        first = await anext(deltas)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(
            backend,
            job,
            builder,
            (first, deltas),
            body.n,
            include_usage,
            lambda totals: _done(metrics, route, totals, started),
        )
        return StreamingResponse(events, media_type="text/event-stream")
    choices = await _while_connected(request, run_choices(backend, job, body.n, shape.is_chat))
    if choices is None:
        access.info("%s 499 client disconnected: the request was aborted", route)
        metrics.refused(route, 499)
        return Response(status_code=499)  # nobody reads it
    totals = _totals(backend, job, choices)
    _done(metrics, route, totals, started)
    whole = [(c.text, c.finish_reason, c.whole_logprobs()) for c in choices]
    return JSONResponse(builder.response(whole, **totals))


async def _while_connected(request: Request, work: Any) -> Any:
    """`work`'s result, or None once the client has gone: then `work` is cancelled, which
    closes the engine's generator and so aborts the request (as a closed stream does)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


def _done(metrics: ServeMetrics, route: str, totals: dict[str, Any], started: float) -> None:
    """A served request's access line and metrics: its tokens and reuse (none after a failed
    stream)."""
    stats = {**totals.get("kmesh", {}), **totals.get("usage", {})}
    counts = " ".join(f"{name}={stats[name]}" for name in _LOGGED if name in stats)
    recovery = stats.get("recovery")
    if isinstance(recovery, dict) and "computed_tokens" in recovery:  # what recovered rows cost
        counts += f" recovery_computed={recovery['computed_tokens']:g}"
        counts += f" recovery_reused={recovery['reused_tokens']}"
    seconds = time.perf_counter() - started
    access.info("%s 200 %s %.3fs", route, counts or "(failed mid-stream)", seconds)
    if stats:
        metrics.served(route, stats, seconds)
    else:
        metrics.refused(route, 500)


async def _events(
    backend: Backend,
    job: GenerationJob,
    builder: ResponseBuilder,
    deltas_from: tuple[tuple[int, Delta], AsyncGenerator[tuple[int, Delta], None]],
    n: int,
    include_usage: bool,
    done: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    """Server-sent events: `data: {chunk}` for each choice's new text (its `index`; with
    job.logprobs, the logprobs of the tokens since its previous chunk), each choice's last chunk
    with its finish_reason, the last of them with kmesh too, then (`include_usage`) a chunk with
    no choices and the usage, then `data: [DONE]`. A failure after the first token ends the
    stream with an error object instead. `done` gets the totals (none after a failure) once the
    stream ends."""
    first, deltas = deltas_from
    totals: dict[str, Any] = {}
    choices = [ChoiceText(backend.tokenizer, job, builder.shape.is_chat) for _ in range(n)]
    async with aclosing(deltas):
        try:
            for index in range(n):
                opening = builder.opening_chunk(index)
                if opening is not None:
                    yield _event(opening)
            (index, delta), finished = first, 0
            while True:
                piece = choices[index].add(delta)
                if delta.finish_reason is not None:
                    assert piece is not None
                    finished += 1
                    reason = choices[index].finish_reason
                    if finished == n:
                        totals = _totals(backend, job, choices)
                        kmesh = totals["kmesh"]
                        yield _event(builder.chunk(*_fields(piece, index, reason), kmesh=kmesh))
                        break
                    yield _event(builder.chunk(*_fields(piece, index, reason)))
                elif piece is not None:
                    yield _event(builder.chunk(*_fields(piece, index, None)))
                index, delta = await anext(deltas)
            if include_usage:
                yield _event(builder.usage_chunk(totals["usage"]))
        except Exception as error:
            logger.exception("a streamed request failed")
            totals = {}
            message = str(error) if isinstance(error, EngineStoppedError) else INTERNAL_ERROR
            yield _event(error_body(message, kind="server_error"))
    done(totals)
    yield "data: [DONE]\n\n"


def _fields(piece: Piece, index: int, reason: str | None) -> tuple[Any, ...]:
    """ResponseBuilder.chunk's positional arguments for a piece of choice `index`."""
    return piece.text, reason, piece.logprobs, index


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _totals(backend: Backend, job: GenerationJob, choices: list[ChoiceText]) -> dict[str, Any]:
    """`usage` and `kmesh` of a finished job: its choices' stats, counts summed over them."""
    stats = []
    for choice in choices:
        assert choice.last is not None and choice.last.stats is not None, "a job without stats"
        stats.append(choice.last.stats)
    kmesh = {**stats[0], **{k: sum(s.get(k, 0) for s in stats) for k in _SUMMED if k in stats[0]}}
    if len(choices) > 1:
        kmesh["branches"] = len(choices)
    family = None if job.kmesh is None else job.kmesh.family
    return {
        "usage": usage(len(job.prompt_ids), sum(len(c.token_ids) for c in choices)),
        "kmesh": {**kmesh, "family": family, "engine": backend.engine},
    }
