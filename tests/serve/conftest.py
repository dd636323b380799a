"""`kmesh serve` as a user runs it: a real process on a free port, and an OpenAI client for it."""

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kmesh.serve.process import ServerProcess, start_kmesh_serve


def start_serve(
    engine: str, log_dir: Path, timeout: float = 120, options: tuple[str, ...] = ()
) -> ServerProcess:
    """`kmesh serve --engine ENGINE --port 0 OPTIONS`, once it printed its ready line."""
    return start_kmesh_serve(engine, log_dir / f"serve-{engine}.log", options, timeout=timeout)


def openai_client(server: ServerProcess, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=600)


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
    streamed, after a 1-token probe sent a second later (vLLM's gauges move only when its
    engine steps), and 2 s after that."""
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
    time.sleep(1)
    probe = {"prompt": "Hello", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=probe, headers=headers, timeout=60).is_success
    after = engine_gauges(url)
    time.sleep(2)
    return {"during": during, "after": after, "later": engine_gauges(url)}


def disconnect_before_the_answer(url: str, headers: dict[str, str] | None = None) -> dict:
    """Ask for 2000 tokens without streaming and give up after 3 s (the client closes the
    connection); the engine's gauges read at 1.5 s, after a 1-token probe sent a second after
    giving up, and 2 s after that (as disconnect_mid_stream's)."""
    body = {
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
    }
    seen: dict[str, Any] = {}
    reader = threading.Timer(1.5, lambda: seen.update(during=engine_gauges(url)))
    reader.start()
    try:
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=3)
        raise AssertionError("2000 tokens came back within 3 s: the test saw no disconnect")
    except httpx.ReadTimeout:
        pass
    reader.join()
    time.sleep(1)
    probe = {"prompt": "Hello", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=probe, headers=headers, timeout=60).is_success
    seen["after"] = engine_gauges(url)
    time.sleep(2)
    seen["later"] = engine_gauges(url)
    return seen


def check_disconnect_freed(seen: dict[str, Any]) -> None:
    """What disconnect_mid_stream or disconnect_before_the_answer saw: the request held blocks,
    then nothing ran or was held once the probe was served."""
    during, after, later = seen["during"], seen["after"], seen["later"]
    assert during["kmesh_engine_running_requests"] == 1 and during["kmesh_engine_kv_usage"] > 0
    assert after["kmesh_engine_running_requests"] == 0, seen
    assert after["kmesh_engine_kv_usage"] == 0, seen
    # No work continues: about 2000 tokens were left; not one more was computed.
    assert (
        later["kmesh_engine_computed_tokens_total"] == after["kmesh_engine_computed_tokens_total"]
    )


# Two tenants' keys (`kmesh serve --api-keys`); A has two.
TENANT_KEYS = {"key-of-team-a": "team-a", "key-of-team-b": "team-b", "2nd-key-of-a": "team-a"}
KEY_A, KEY_B, KEY_A2 = TENANT_KEYS
SHARED_TEXT = (
    "The council of the river towns meets once a year in the old mill. Each town sends one "
    "speaker, who reports on the harvest, the state of the bridges, the price of salt and the "
    "quarrels that the town could not settle by itself. "
)


def keys_file(folder: Path) -> Path:
    path = folder / "keys.json"
    path.write_text(json.dumps(TENANT_KEYS))
    return path


def complete_as(client: httpx.Client, key: str, prompt: str, **body: Any) -> dict[str, Any]:
    """The kmesh stats of a 1-token greedy completion sent with `key`."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **body}
    headers = {"Authorization": f"Bearer {key}"}
    response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["kmesh"]


def tenancy_observations(client: httpx.Client) -> dict[str, Any]:
    """What tenant A gets after tenant B computed a prompt: A's stats under several salts
    (some naming B's namespace), A's own repeat (the control), and first-token seconds of A's
    prompts after B sent them, against prompts nobody sent, and A's own repeats."""
    prompt = SHARED_TEXT + "The oldest speaker said"
    complete_as(client, KEY_B, prompt, cache_salt="shared")
    salts: tuple[str | None, ...] = ("shared", None, "shared#tenant=team-b", "#tenant=team-b")
    cross = [
        complete_as(client, KEY_A, prompt, **({} if s is None else {"cache_salt": s}))
        for s in salts
    ]
    own = complete_as(client, KEY_A2, prompt, cache_salt="shared")

    def long_prompt(i: int) -> str:  # about 1000 tokens, each a prompt of its own
        return f"Record {i}. " + SHARED_TEXT * 18

    def seconds(key: str, text: str) -> float:
        started = time.perf_counter()
        complete_as(client, key, text)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"after_b": [], "cold": [], "own": []}
    for i in range(5):
        complete_as(client, KEY_B, long_prompt(2 * i))
        times["after_b"].append(seconds(KEY_A, long_prompt(2 * i)))
        times["cold"].append(seconds(KEY_A, long_prompt(2 * i + 1)))
        times["own"].append(seconds(KEY_A, long_prompt(2 * i + 1)))
    return {"cross": cross, "own": own, "seconds": times}


def check_tenancy(seen: dict[str, Any]) -> None:
    for stats in seen["cross"]:
        assert stats["reused_tokens"] == 0 and stats["restored_tokens"] == 0, seen
    assert seen["own"]["reused_tokens"] > 0, seen  # the control: A's own state is reused
    times = {name: statistics.median(values) for name, values in seen["seconds"].items()}
    assert 0.7 < times["after_b"] / times["cold"] < 1.4, seen["seconds"]
    assert times["own"] < 0.5 * times["cold"], seen["seconds"]  # the test would see a hit
