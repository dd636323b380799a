"""The HTTP side of `kmesh serve`: OpenAI's /v1/models, /v1/completions, /v1/chat/completions.

Every response carries a top-level `kmesh` object (a stream: its last chunk, with usage):
prompt_tokens, computed_tokens, reused_tokens (local prefix cache), restored_tokens (external
store), family and engine. A caller's mistake gets HTTP 400 in OpenAI's error shape with a message
that says what to change; anything else gets 500 and a traceback in the server's log only.
"""

import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from kmesh.errors import KMeshError
from kmesh.serve.backend import Backend, Delta, GenerationJob
from kmesh.serve.detokenizer import IncrementalDecoder
from kmesh.serve.jobs import chat_job, completion_job
from kmesh.serve.schema import (
    CHAT,
    COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    ResponseShape,
    error_body,
    usage,
)

logger = logging.getLogger(__name__)

INTERNAL_ERROR = "internal server error (the server's log has the details); retry or report it"
ROUTES = "GET /v1/models, POST /v1/completions and POST /v1/chat/completions"
# A union alternative's place in an error's loc (like "str" or "list[TextPart]"), not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool)$|\[")
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def create_app(backend: Backend, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The server's app; it starts the backend on startup (then calls `on_ready`) and closes
    it on shutdown."""

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
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(KMeshError, _refused)
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": backend.model_id, "object": "model", "created": 0, "owned_by": "kmesh"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        return await _respond(backend, completion_job(body, backend), COMPLETION, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await _respond(backend, chat_job(body, backend), CHAT, body.stream)

    return app


async def _respond(
    backend: Backend, job: GenerationJob, shape: ResponseShape, stream: bool
) -> Response:
    builder = ResponseBuilder.new(shape, backend.model_id)
    decoder = IncrementalDecoder(backend.tokenizer)
    if stream:
        deltas = backend.generate(job)
        # Errors before the first token (the engine refusing the job) are still HTTP errors.
        first = await anext(deltas)
        events = _events(backend, job, builder, decoder, first, deltas)
        return StreamingResponse(events, media_type="text/event-stream")
    last = Delta(())
    async with aclosing(backend.generate(job)) as deltas:
        async for last in deltas:
            decoder.add(last.token_ids)
    totals = _totals(backend, job, last, decoder)
    return JSONResponse(builder.response(decoder.take_rest(), _finish_reason(last), **totals))


async def _events(
    backend: Backend,
    job: GenerationJob,
    builder: ResponseBuilder,
    decoder: IncrementalDecoder,
    first: Delta,
    deltas: AsyncGenerator[Delta, None],
) -> AsyncIterator[str]:
    """Server-sent events: `data: {chunk}` for new text, the last chunk with finish_reason,
    usage and kmesh, then `data: [DONE]`. A failure after the first token ends the stream
    with an error object instead of the last chunk."""
    async with aclosing(deltas):
        try:
            opening = builder.opening_chunk()
            if opening is not None:
                yield _event(opening)
            delta = first
            while delta.finish_reason is None:
                decoder.add(delta.token_ids)
                text = decoder.take_complete()
                if text:
                    yield _event(builder.chunk(text))
                delta = await anext(deltas)
            decoder.add(delta.token_ids)
            totals = _totals(backend, job, delta, decoder)
            yield _event(builder.chunk(decoder.take_rest(), delta.finish_reason, **totals))
        except Exception:
            logger.exception("a streamed request failed")
            yield _event(error_body(INTERNAL_ERROR, kind="server_error"))
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _finish_reason(delta: Delta) -> str:
    assert delta.finish_reason is not None, "a backend ended a job without a finish reason"
    return delta.finish_reason


def _totals(
    backend: Backend, job: GenerationJob, last: Delta, decoder: IncrementalDecoder
) -> dict[str, Any]:
    """`usage` and `kmesh` of a finished job."""
    assert last.stats is not None, "a backend ended a job without stats"
    family = None if job.kmesh is None else job.kmesh.family
    return {
        "usage": usage(len(job.prompt_ids), decoder.num_tokens),
        "kmesh": {**last.stats, "family": family, "engine": backend.engine},
    }


async def _invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation_errors(exc.errors(), _BODIES.get(request.url.path))
    return JSONResponse(error_body(message, param), status_code=400)


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(exc), getattr(exc, "param", None)), status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail}: {request.method} {request.url.path}; this server serves {ROUTES}"
    return JSONResponse(error_body(message), status_code=exc.status_code)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # NOTE: Starlette re-raises the exception after this response, and uvicorn logs it.
    return JSONResponse(error_body(INTERNAL_ERROR, kind="server_error"), status_code=500)


def describe_validation_errors(
    errors: Sequence[Any], body: type[BaseModel] | None
) -> tuple[str, str | None]:
    """One message for pydantic's errors on a request body, and the first field at fault."""
    problems: list[str] = []
    # Field -> what each alternative of its type says (a union reports one error per type).
    wrong: dict[str, list[str]] = {}
    for error in errors:
        loc = [str(part) for part in error["loc"][1:] if not _TYPE_TAG.search(str(part))]
        field = ".".join(loc)
        kind = error["type"]
        if kind == "json_invalid":
            reason = error.get("ctx", {}).get("error", "")
            problems.append(f"the body is not valid JSON ({reason}): send a JSON object")
        elif not loc:
            problems.append(
                "the body is missing: send a JSON object"
                if kind == "missing"
                else "the body must be a JSON object (Content-Type: application/json)"
            )
        elif kind == "extra_forbidden":
            top_level = body is not None and len(loc) == 1
            fields = f" (fields: {', '.join(body.model_fields)})" if top_level and body else ""
            wrong.setdefault(field, []).append(f"unknown field: remove it{fields}")
        else:
            says = wrong.setdefault(field, [])
            says.append(error["msg"].removeprefix("Input should be ") if says else error["msg"])
    problems += [f"{field}: {' or '.join(says)}" for field, says in wrong.items()]
    return "; ".join(problems), next(iter(wrong), None)
