"""`kmesh bench fork --engine vllm`, small, as a user runs it, on tiny models of two families
whose contexts (2048 and 4096 positions) reach vLLM only from their config.json (no
--max-model-len): its accounting against vLLM's own counters, and an exit without a traceback."""

import json

import pytest

from kmesh.bench.fork.run import ForkBenchConfig, ideal_prompt_tokens
from kmesh.bench.fork.vllm import STRATEGIES
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


def test_every_strategy_computes_the_context_at_least_once_and_kmesh_samples_as_independent(
    tmp_path, family_folder
):
    """Llama 2 (4096 positions), a tree over a 100-token trunk: three whole 32-token pages and a
    partial one, which each branch of plain vLLM recomputes."""
    cfg = ForkBenchConfig(mode="tree", branches=2, trunk_tokens=100, branch_tokens=8)
    report = fork_bench(
        family_folder("llama2"), tmp_path / "fork.json",
        "--mode", "tree", "--branches", "2", "--trunk-tokens", "100", "--branch-tokens", "8",
    )  # fmt: skip
    ideal = ideal_prompt_tokens(cfg)
    assert ideal == 100 + 2 * 8
    for name in STRATEGIES:
        row = report["strategies"][name]
        # 2 node requests of the trunk, 4 leaves of trunk + node: every prompt counted once.
        assert row["prompt_tokens"] == 2 * 100 + 4 * 108
        assert ideal <= row["computed_prompt_tokens"] <= row["prompt_tokens"] + 2 * 8
        assert row["computed_prompt_tokens"] == row["prompt_tokens"] - row["cached_tokens"] + 16
        assert row["cached_tokens"] >= 96  # the trunk's whole pages, at least once
    assert report["kmesh_leaves_identical_to_independent"] == 1.0  # same seeds, exact cache
    # kmesh's branches take the fork point's partly used page from the page tail the first
    # branch (or the node that generated it) left: each computes only its prompt's last token,
    # the second node and the four leaves one token each.
    assert report["strategies"]["kmesh"]["computed_prompt_tokens"] == ideal + 1 + 4
    for name in ("independent", "vllm_n"):  # plain vLLM: the partial page again per branch
        assert report["strategies"][name]["computed_prompt_tokens"] > ideal + 1 + 4
