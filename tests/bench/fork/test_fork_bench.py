"""`kmesh bench fork`: the accounting and the exactness it reports."""

import json

import pytest

from kmesh.bench.fork.run import ForkBenchConfig, run_fork_bench
from tests.conftest import run_kmesh

ATOL = 1e-4  # the tiny model's executor tolerance (tests/compute/test_executor_tiny.py)


@pytest.fixture(scope="module", params=["best-of-n", "cot", "tree"])
def report(request, tiny):
    executor, fingerprint = tiny
    cfg = ForkBenchConfig(
        request.param, branches=3, trunk_tokens=50, branch_tokens=6, reasoning_tokens=10
    )
    return cfg, run_fork_bench(executor, fingerprint, cfg)


def test_fork_computes_exactly_the_ideal_context(report):
    _, r = report
    fork = r["strategies"]["fork"]
    assert fork["computed_prompt_tokens"] == fork["ideal_prompt_tokens"]


def test_prefix_cache_recomputes_partial_blocks_and_independent_everything(report):
    cfg, r = report
    s = r["strategies"]
    assert s["fork"]["computed_prompt_tokens"] < s["prefix_cache"]["computed_prompt_tokens"]
    assert s["prefix_cache"]["computed_prompt_tokens"] < s["independent"]["computed_prompt_tokens"]
    if cfg.mode == "best-of-n":
        assert s["independent"]["computed_prompt_tokens"] == cfg.branches * cfg.trunk_tokens
        # 50 = 3 blocks of 16 + 2: each later branch recomputes the 2-token partial block.
        assert s["prefix_cache"]["computed_prompt_tokens"] == 50 + 2 * 2


def test_fork_branches_are_identical_to_independent_ones(report):
    _, r = report
    assert r["branches_identical"] == 1.0
    assert 0 <= r["max_logit_diff_fork_vs_independent"] <= ATOL


def test_fork_kv_peak_is_within_trunk_plus_own_tokens_plus_a_block_per_branch(report):
    _, r = report
    assert 0 < r["strategies"]["fork"]["kv_bytes_peak"] <= r["fork_kv_bytes_bound"]
    assert (
        r["strategies"]["fork"]["kv_bytes_peak"] < r["strategies"]["independent"]["kv_bytes_peak"]
    )


@pytest.mark.model
def test_cli_writes_the_report_and_prints_a_table(tmp_path):
    path = tmp_path / "out" / "fork.json"
    result = run_kmesh(
        "bench",
        "fork",
        "--mode",
        "best-of-n",
        "--branches",
        "3",
        "--trunk-tokens",
        "120",
        "--branch-tokens",
        "5",
        "--json",
        str(path),
    )
    assert result.returncode == 0, result.stderr
    assert "prefix_cache" in result.stdout and "fork" in result.stdout
    r = json.loads(path.read_text())
    assert set(r["strategies"]) == {"independent", "prefix_cache", "fork"}
    for row in r["strategies"].values():
        assert {"computed_prompt_tokens", "ideal_prompt_tokens", "kv_bytes_peak", "seconds"} <= set(
            row
        )
    assert r["strategies"]["fork"]["computed_prompt_tokens"] == 120
    assert r["branches_identical"] == 1.0
    assert r["max_logit_diff_fork_vs_independent"] <= 1e-3


def test_cli_refuses_bad_sizes():
    result = run_kmesh(
        "bench",
        "fork",
        "--mode",
        "tree",
        "--branches",
        "0",
        "--json",
        "x.json",
    )
    assert result.returncode == 2
    assert "--branches must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr
