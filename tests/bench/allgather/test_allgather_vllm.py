"""`kmesh bench allgather --engine vllm` on a slice of the committed 8-agent trace (2 agents,
rounds 0 and 1; each round-1 prompt still reads all 8 round-0 outputs), as a process: the
reference bench's JSON, exact strategies exact, recovery cheaper than vanilla prefix caching."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kmesh.bench.allgather.config import STRATEGIES
from kmesh.workloads.trace import load_trace, save_trace

pytestmark = [pytest.mark.model, pytest.mark.vllm]

AGENTS = 2
TRACE = Path(__file__).parents[3] / "docs" / "results" / "allgather-trace-8x3.jsonl"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("allgather-vllm")
    workload, model, turns = load_trace(TRACE)
    save_trace(
        out / "trace.jsonl", workload, model, [t for t in turns if t.agent < AGENTS and t.round < 2]
    )
    command = ["bench", "allgather", "--engine", "vllm", "--trace", str(out / "trace.jsonl")]
    done = subprocess.run(
        [sys.executable, "-m", "kmesh.cli", *command, "--json", str(out / "report.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "collective" in done.stdout  # the table
    return json.loads((out / "report.json").read_text())


def test_the_report_has_the_reference_benchs_shape(report):
    assert set(report["strategies"]) == set(STRATEGIES)
    assert report["config"]["engine"] == "vllm" and report["config"]["agents"] == AGENTS
    for row in report["strategies"].values():
        assert len(row["per_round"]) == 2 and row["quality"]["samples"] == AGENTS


def test_exact_strategies_match_vllms_full_prefill(report):
    strategies = report["strategies"]
    assert strategies["full"]["quality"]["kl_mean"] == 0
    prefix = strategies["prefix"]["quality"]
    assert prefix["kl_mean"] < 1e-6 and prefix["greedy_match_32"] == 1.0


def test_recovery_computes_less_than_prefix_caching_and_stays_close(report):
    strategies = report["strategies"]
    prefix = strategies["prefix"]["computed_tokens_reuse_rounds"]
    for name in ("per_request", "collective"):
        row = strategies[name]
        assert row["computed_tokens_reuse_rounds"] < 0.9 * prefix, name
        assert row["fallbacks"] == 0 and row["check_deviation_max"] < 0.1, name
        assert row["quality"]["kl_mean"] < 0.1, name  # a real distance, measured
    assert strategies["collective"]["kv_bytes_master"] > 0
