"""`kmesh serve --engine reference` as a process, used through the OpenAI Python client."""

import socket

import httpx
import openai
import pytest

from tests.conftest import run_kmesh
from tests.serve.conftest import (
    check_disconnect_freed,
    disconnect_before_the_answer,
    disconnect_mid_stream,
    openai_client,
)

pytestmark = pytest.mark.model

TRUNK = (
    "You are the archivist of a mountain library. The library keeps maps, letters and the "
    "records of every expedition that left the valley in the last two hundred years. "
)


@pytest.fixture(scope="module")
def server(reference_server):
    return reference_server


def test_a_completion_with_kmesh_segments_through_the_openai_client(server):
    client = openai_client(server)
    [model] = client.models.list().data
    segments = [
        {"text": TRUNK, "role": "shared", "id": "archive"},
        {"text": "The oldest map shows", "role": "private"},
    ]
    kmesh = {"family": "archive", "branches": 2, "segments": segments}
    first = client.completions.create(
        model=model.id, prompt="", max_tokens=6, temperature=0, extra_body={"kmesh": kmesh}
    )
    assert first.choices[0].text
    stats = first.model_extra["kmesh"]
    assert stats["family"] == "archive"
    assert stats["engine"] == "reference"
    assert stats["prompt_tokens"] == first.usage.prompt_tokens
    segments[1]["text"] = "The newest letter says"
    second = client.completions.create(
        model=model.id,
        prompt=TRUNK + segments[1]["text"],
        max_tokens=6,
        temperature=0,
        extra_body={"kmesh": kmesh},
    )
    stats = second.to_dict()["kmesh"]
    assert stats["reused_tokens"] > 0
    assert stats["prompt_tokens"] == (
        stats["computed_tokens"] + stats["reused_tokens"] + stats["restored_tokens"]
    )


def test_a_streamed_chat_through_the_openai_client(server):
    client = openai_client(server)
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"kmesh": {"family": "geo"}},
        )
    )
    *text_chunks, usage = chunks
    text = "".join(chunk.choices[0].delta.content or "" for chunk in text_chunks)
    assert "Paris" in text
    last = text_chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.model_extra["kmesh"]["family"] == "geo"
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens > 0


def test_a_bad_request_raises_the_clients_bad_request_error(server):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 16"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", n=17)
    answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)
    assert answer.usage.completion_tokens == 1


def test_a_prompt_that_is_not_unicode_is_a_400(server):
    body = b'{"prompt": "\\ud800", "max_tokens": 1}'  # valid JSON: a lone surrogate's escape
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("prompt: the text is not valid Unicode")


def test_a_taken_port_is_one_clear_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_kmesh("serve", "--engine", "reference", "--port", str(port), timeout=60)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_client_that_closes_its_stream_frees_the_request(server):
    check_disconnect_freed(disconnect_mid_stream(server.url))


def test_a_client_that_gives_up_on_a_whole_answer_frees_the_request(server):
    check_disconnect_freed(disconnect_before_the_answer(server.url))


def test_health_says_ready(server):
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 200 and response.json()["status"] == "ready"
