"""vLLM's own load client, `vllm bench serve` (run as `kmesh vllm bench serve` from this install),
against `kmesh serve --engine reference`: its completions and chat backends, no failed request.

Marked vllm: the client imports vLLM (about 20 s each run on 2 cores).
"""

import json
import subprocess
import sys

import pytest

from kmesh.compute.embedded import ensure_embedded_model

pytestmark = [pytest.mark.model, pytest.mark.vllm]

PROMPTS = 8
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def server(reference_server):
    return reference_server


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_gets_every_request_served(server, tmp_path, backend, endpoint):
    command = [sys.executable, "-m", "kmesh.cli", "vllm", "bench", "serve"]
    command += ["--backend", backend, "--endpoint", endpoint, "--base-url", server.url]
    command += ["--model", "SmolLM2-135M-Instruct", "--tokenizer", str(ensure_embedded_model())]
    command += ["--dataset-name", "prefix_repetition", "--num-prompts", str(PROMPTS)]
    command += ["--prefix-repetition-prefix-len", "128", "--prefix-repetition-suffix-len", "32"]
    command += ["--prefix-repetition-num-prefixes", "2"]
    command += ["--prefix-repetition-output-len", str(OUTPUT_LEN), "--max-concurrency", "4"]
    command += ["--ignore-eos"]  # every request generates OUTPUT_LEN tokens
    command += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (PROMPTS, 0), result.get("errors")
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
