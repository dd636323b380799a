"""A plain vLLM OpenAI server with KMeshConnector and KMesh's worker class recovers by itself:
no dev mode, no /collective_rpc (kmesh/vllm/worker.py)."""

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kmesh.compute.embedded import ensure_embedded_model
from kmesh.vllm.config import WORKER, kv_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.model]

START_TIMEOUT_S = 300
TEXT = (
    "The council of the river towns meets once a year in the old mill. Each town sends one "
    "speaker, who reports on the harvest, the state of the bridges, the price of salt and the "
    "quarrels that the town could not settle by itself. "
) * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(ensure_embedded_model()), "--port", str(port)]
    command += ["--dtype", "float32", "--enforce-eager", "--block-size", "32"]
    command += ["--kv-cache-memory-bytes", str(1 << 29), "--max-model-len", "4096"]
    transfer = json.dumps(kv_transfer_config(None))
    command += ["--worker-cls", WORKER, "--kv-transfer-config", transfer]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "vLLM's server did not start in time"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def test_a_recovery_request_to_plain_vllm_serve_reports_recovered_tokens(server):
    [model] = httpx.get(f"{server}/v1/models").json()["data"]
    kmesh = {
        "segments": [
            {"text": TEXT, "role": "shared", "id": "notes"},
            {"text": "In one word, the towns are", "role": "instruction"},
        ],
        "recovery": {"policy": "full"},
    }
    body = {
        "model": model["id"],
        "prompt": TEXT + "In one word, the towns are",
        "max_tokens": 4,
        "temperature": 0,
        "kv_transfer_params": {"kmesh": kmesh},
    }
    answer = httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()
    stats = answer["kv_transfer_params"]["kmesh"]
    assert stats["recovered_tokens"] >= 64, stats  # whole 32-token pages, by KMesh's executor
    assert stats["recovery"]["computed_tokens"] == stats["recovered_tokens"]
    assert not stats["recovery"]["fell_back"]
