"""A plain vLLM OpenAI server with KMeshConnector and KMesh's worker class recovers by itself:
no dev mode, no /collective_rpc (kmesh/vllm/worker.py)."""

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kmesh.compute.embedded import ensure_embedded_model
from kmesh.serve.process import start_vllm_server
from kmesh.vllm.config import vllm_engine_kwargs

pytestmark = [pytest.mark.vllm, pytest.mark.model]

TEXT = (
    "The council of the river towns meets once a year in the old mill. Each town sends one "
    "speaker, who reports on the harvest, the state of the bridges, the price of salt and the "
    "quarrels that the town could not settle by itself. "
) * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    kwargs = vllm_engine_kwargs(ensure_embedded_model(), kv_cache_bytes=1 << 29, max_model_len=4096)
    server = start_vllm_server(kwargs, log)
    yield server
    server.stop()


def complete(server, **body) -> dict:
    [model] = httpx.get(f"{server.url}/v1/models").json()["data"]
    body = {"model": model["id"], "max_tokens": 4, "temperature": 0, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_recovery_request_to_plain_vllm_serve_reports_recovered_tokens(server):
    kmesh = {
        "segments": [
            {"text": TEXT, "role": "shared", "id": "notes"},
            {"text": "In one word, the towns are", "role": "instruction"},
        ],
        "recovery": {"policy": "full"},
    }
    answer = complete(
        server, prompt=TEXT + "In one word, the towns are", kv_transfer_params={"kmesh": kmesh}
    )
    stats = answer["kv_transfer_params"]["kmesh"]
    assert stats["recovered_tokens"] >= 64, stats  # whole 32-token pages, by KMesh's executor
    assert stats["recovery"]["computed_tokens"] == stats["recovered_tokens"]
    assert not stats["recovery"]["fell_back"]
    assert recovered_on_metrics(server.url) >= stats["recovered_tokens"]  # vLLM's own /metrics


@pytest.mark.parametrize(
    ("kmesh", "logged"),
    [
        (
            {"family": "f", "recovery": {"round": {"id": "r", "segments": ["nowhere"]}}},
            "unknown segment ids",
        ),
        ({"segments": [{"text": "not the prompt", "id": "x"}]}, "do not spell its prompt"),
        ({"famly": "f"}, "famly"),
    ],
)
def test_a_bad_kmesh_object_on_plain_vllm_is_logged_and_served_exactly(server, kmesh, logged):
    prompt = "The council of the river towns decided"
    plain = complete(server, prompt=prompt)
    answer = complete(server, prompt=prompt, kv_transfer_params={"kmesh": kmesh})
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
    assert answer["kv_transfer_params"]["kmesh"]["recovered_tokens"] == 0
    assert logged in server.log.read_text()


def recovered_on_metrics(server: str) -> float:
    """kmesh_tokens_total{kind="recovered"} on vLLM's /metrics (kmesh/vllm/metrics.py), once
    vLLM's front end has recorded the step's stats (within a few seconds)."""
    for _ in range(30):
        families = text_string_to_metric_families(httpx.get(f"{server}/metrics").text)
        recovered = sum(
            s.value
            for family in families
            for s in family.samples
            if s.name == "kmesh_tokens_total" and s.labels.get("kind") == "recovered"
        )
        if recovered:
            return recovered
        time.sleep(0.5)
    return 0.0
