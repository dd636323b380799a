"""`kmesh bench fork --engine vllm` as a user runs it, on a tiny Mistral whose context (2048
positions) reaches vLLM only from its config.json (no --max-model-len): best-of-4's accounting
against vLLM's own counters, leaves identical to independent requests, an exit without a
traceback. (Tree and chain-of-thought forks' page tails inside vLLM: tests/vllm/
test_families_vllm.py; the bench's other modes: tests/bench/fork/test_fork_bench.py.)"""

import json

import pytest

from kmesh.bench.fork.run import ForkBenchConfig, ideal_prompt_tokens
from tests.conftest import run_kmesh

pytestmark = [pytest.mark.model, pytest.mark.vllm]


def fork_bench(folder, out, *args: str) -> dict:
    result = run_kmesh(
        "bench", "fork", "--engine", "vllm", "--model", str(folder), *args, "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    # vLLM's engine is shut down once, in the bench: nothing raises at the interpreter's exit.
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    return json.loads(out.read_text())


def test_best_of_4_computes_the_trunk_once_with_leaves_identical_to_independent_requests(
    tmp_path, family_folder
):
    """Mistral (2048 positions): four leaves over a 1024-token trunk (whole pages), each
    later leaf computing only its last prompt token."""
    report = fork_bench(
        family_folder("mistral_global"), tmp_path / "fork.json",
        "--mode", "best-of-n", "--branches", "4", "--branch-tokens", "8",
    )  # fmt: skip
    ideal = ideal_prompt_tokens(
        ForkBenchConfig(mode="best-of-n", branches=4, trunk_tokens=1024, branch_tokens=8)
    )
    assert ideal == 1024
    kmesh = report["strategies"]["kmesh"]
    assert kmesh["prompt_tokens"] == 4 * 1024
    assert kmesh["computed_prompt_tokens"] == ideal + 3 <= 1.02 * ideal
    assert report["kmesh_leaves_identical_to_independent"] == 1.0
