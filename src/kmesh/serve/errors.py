"""The HTTP error answers of `kmesh serve`, in OpenAI's error shape (kmesh/serve/schema.py).

A caller's mistake gets 400 with a message that says what to change (a body that could not be
read or that pydantic refused, text that is not Unicode among it; a KMeshError); a missing or
unknown API key 401; an unknown route 404 (naming the routes served); an engine that failed 503
(what failed, "restart kmesh serve"); anything else 500 with no details (the traceback goes to
the server's log). Each answer is logged on the access log and counted in /metrics.
"""

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kmesh.errors import KMeshError
from kmesh.serve.backend import EngineStoppedError
from kmesh.serve.schema import error_body
from kmesh.serve.unicode_text import NOT_UNICODE, LoneSurrogate, lone_surrogate
from kmesh.state.tenants import AuthenticationError

access = logging.getLogger("kmesh.serve.access")

INTERNAL_ERROR = "internal server error (the server's log has the details); retry or report it"
ROUTES = (
    "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize, "
    "POST /detokenize, GET /metrics and GET /health"
)
# The route of a request no route serves (a path or method this server does not know). NOTE:
# never the path or method itself: each would be a /metrics label kept for the server's life,
# as many as a client cares to send.
UNKNOWN_ROUTE = "unknown route"
# A union alternative's place in an error's loc (like "str" or "list[TextPart]"), not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool)$|\[")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(KMeshError, _refused)
    app.add_exception_handler(EngineStoppedError, _engine_stopped)
    app.add_exception_handler(AuthenticationError, _unauthorized)
    app.add_exception_handler(Exception, _unexpected)


def route_of(request: Request) -> str:
    """What the access log and /metrics name a request by: its method and the route serving it,
    or UNKNOWN_ROUTE."""
    route = request.scope.get("route")
    if route is None or request.method not in getattr(route, "methods", ()):
        return UNKNOWN_ROUTE
    return f"{request.method} {route.path}"


async def _invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation_errors(exc.errors())
    return _error(request, 400, message, param)


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    return _error(request, 400, str(exc), getattr(exc, "param", None))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400:  # FastAPI could not read the body (bytes that are not UTF-8)
        message = f"{exc.detail}: send a JSON object in UTF-8 (Content-Type: application/json)"
    else:
        message = f"{exc.detail}: {request.method} {request.url.path}; this server serves {ROUTES}"
    return _error(request, exc.status_code, message)


async def _unauthorized(request: Request, exc: Exception) -> JSONResponse:
    response = _error(request, 401, str(exc), kind="invalid_request_error")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _engine_stopped(request: Request, exc: Exception) -> JSONResponse:
    return _error(request, 503, str(exc), kind="server_error")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # NOTE: Starlette re-raises the exception after this response, and uvicorn logs it.
    return _error(request, 500, INTERNAL_ERROR, kind="server_error")


def _error(
    request: Request,
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
) -> JSONResponse:
    access.info("%s %d %s", route_of(request), status, message)
    request.app.state.metrics.refused(route_of(request), status)
    return JSONResponse(error_body(message, param, kind), status_code=status)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One message for pydantic's errors on a request body, and the first field at fault."""
    problems: list[str] = []
    # Field -> what each alternative of its type says (a union reports one error per type).
    wrong: dict[str, list[str]] = {}
    for error in errors:
        loc = [str(part) for part in error["loc"][1:] if not _TYPE_TAG.search(str(part))]
        field = ".".join(loc)
        kind = error["type"]
        if kind == NOT_UNICODE:
            within, message = _not_unicode(error)
            wrong.setdefault(".".join(p for p in (field, within) if p), []).append(message)
        elif kind == "json_invalid":
            reason = error.get("ctx", {}).get("error", "")
            problems.append(f"the body is not valid JSON ({reason}): send a JSON object")
        elif not loc:
            problems.append(
                "the body is missing: send a JSON object"
                if kind == "missing"
                else "the body must be a JSON object (Content-Type: application/json)"
            )
        else:
            says = wrong.setdefault(field, [])
            says.append(error["msg"].removeprefix("Input should be ") if says else error["msg"])
    problems += [f"{field}: {' or '.join(says)}" for field, says in wrong.items()]
    return "; ".join(problems), next(iter(wrong), None)


def _not_unicode(error: Any) -> tuple[str, str]:
    """The dotted field (within the error's loc) of a string that is not Unicode text, and what
    to say about it. NOTE: the text is never echoed: the answer is UTF-8, which cannot hold it."""
    ctx = error.get("ctx") or {}
    # pydantic's own check (of a constrained string) has no ctx: its input is the text.
    found = LoneSurrogate(**ctx) if "code" in ctx else lone_surrogate(error.get("input"))
    where = "" if found is None else f": character {found.index} is a lone surrogate"
    where += "" if found is None else f" (\\u{found.code:04x}, half of a UTF-16 pair)"
    message = (
        f"the text is not valid Unicode{where}; send UTF-8 text, and escape a character past "
        "U+FFFF in JSON as both halves of its pair (\\ud83d\\ude00)"
    )
    return ("" if found is None else found.field), message
