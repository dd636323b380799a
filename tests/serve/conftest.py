"""`kmesh serve` as a user runs it: a real process on a free port, and an OpenAI client for it."""

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kmesh.serve.process import ServerProcess, start_kmesh_serve


def start_serve(engine: str, log_dir: Path, timeout: float = 120) -> ServerProcess:
    """`kmesh serve --engine ENGINE --port 0`, once it printed its ready line."""
    return start_kmesh_serve(engine, log_dir / f"serve-{engine}.log", timeout=timeout)


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def reference_server(tmp_path_factory):
    """`kmesh serve --engine reference` for a module's tests; its log must hold no traceback."""
    server = start_serve("reference", tmp_path_factory.mktemp("serve"))
    yield server
    log = server.stop()
    assert "Traceback" not in log, log


def engine_gauges(url: str) -> dict[str, float]:
    """The kmesh_engine_* samples of a server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in text.splitlines())
        if name.startswith("kmesh_engine_")
    }


def disconnect_mid_stream(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Open a stream of 2000 tokens, read three chunks, close it; the engine's gauges while it
    streamed, once it has no running request (within 30 s), and 2 s after that."""
    body = {
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
        during = engine_gauges(url)
    deadline = time.monotonic() + 30
    while (after := engine_gauges(url))["kmesh_engine_running_requests"] and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    time.sleep(2)
    return {"during": during, "after": after, "later": engine_gauges(url)}


def check_disconnect_freed(seen: dict[str, Any]) -> None:
    """What disconnect_mid_stream saw: the request held blocks, then nothing ran or was held."""
    during, after, later = seen["during"], seen["after"], seen["later"]
    assert during["kmesh_engine_running_requests"] == 1 and during["kmesh_engine_kv_usage"] > 0
    assert after["kmesh_engine_running_requests"] == 0, seen
    assert after["kmesh_engine_kv_usage"] == 0, seen
    # No work continues: about 2000 tokens were left; not one more was computed.
    assert (
        later["kmesh_engine_computed_tokens_total"] == after["kmesh_engine_computed_tokens_total"]
    )
