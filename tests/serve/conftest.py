"""`kmesh serve` as a user runs it: a real process on a free port, and an OpenAI client for it."""

from pathlib import Path

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
