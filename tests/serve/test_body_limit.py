"""`kmesh serve --max-body`: a body past the bound is a 413 in OpenAI's shape before the app
reads it, announced (Content-Length) or chunked; a body within it reaches the app whole."""

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kmesh.serve.body_limit import BodyLimit
from tests.conftest import run_kmesh

LIMIT = 1000


def client() -> tuple[TestClient, list[int]]:
    """A client of an app behind the bound that records the length of each body it read."""
    app = FastAPI()
    read: list[int] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        read.append(len(await request.body()))
        return {"bytes": read[-1]}

    return TestClient(BodyLimit(app, LIMIT)), read


def chunks(total: int, size: int = 100):
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


def test_a_body_within_the_bound_reaches_the_app_whole():
    http, read = client()
    assert http.post("/echo", content=b"x" * LIMIT).json() == {"bytes": LIMIT}
    assert http.post("/echo", content=chunks(LIMIT)).json() == {"bytes": LIMIT}
    assert read == [LIMIT, LIMIT]


def test_a_body_past_the_bound_is_a_413_the_app_never_answers():
    http, read = client()
    for content in (b"x" * (LIMIT + 1), chunks(5 * LIMIT)):
        response = http.post("/echo", content=content)
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "larger than this server takes (1000 bytes)" in error["message"]
        assert "--max-body" in error["message"]
    assert read == []  # announced: never read; chunked: the app was told the client left
    assert http.post("/echo", content=b"x").json() == {"bytes": 1}  # still serving


def test_a_bad_max_body_is_one_line_before_the_model_loads():
    result = run_kmesh(
        "serve", "--engine", "reference", "--max-body", "lots", "--port", "0", timeout=60
    )
    assert result.returncode == 2
    assert "--max-body takes a size in bytes like 1048576, 512M or 2G; got 'lots'" in result.stderr
    assert "Traceback" not in result.stderr
