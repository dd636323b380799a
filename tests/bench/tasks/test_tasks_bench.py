"""`kmesh bench tasks` end to end on the reference engine: a 2-member council, 2 rounds, two
budgets, on the embedded model (bench/tasks/run.py, bench/tasks/reference.py)."""

import pytest

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.tasks.config import TasksBenchConfig
from kmesh.bench.tasks.reference import run_reference_tasks
from kmesh.bench.tasks.run import EXACT
from kmesh.cli import main
from kmesh.workloads.tasks import KINDS, TasksConfig

# Two tasks (a forced record, a choice) and one budget: the suite's budget for this file.
BENCH = TasksBenchConfig(
    budgets=(0.2,),
    selections=("query",),
    default_selection="first_k",
    tasks=("record_reading", "lookup"),
)


@pytest.fixture(scope="module")
def report() -> dict:
    return run_reference_tasks(TasksConfig(agents=2, rounds=2), BENCH, AllGatherBenchConfig())


def test_the_report_has_the_shape_others_read(report):
    assert report["default_selection"] == "first_k"
    assert report["model"] and report["config"]["agents"] == 2
    assert set(report["tasks"]) == set(BENCH.tasks)
    for entry in report["tasks"].values():
        assert entry["gated"] == (entry["full_accuracy"] >= BENCH.accuracy_gate)
        assert set(entry["strategies"]) == {*EXACT, "per_request", "collective", "collective+query"}
        for strategy in entry["strategies"].values():
            assert set(strategy["by_budget"]) == {"0.2"}
            for row in strategy["by_budget"].values():
                for key in ("accuracy", "retention", "retention_ci", "agreement"):
                    assert key in row
                assert row["computed_tokens"] > 0 and row["seconds"] > 0


def test_full_prefill_agrees_with_itself_and_exact_reuse_answers_as_it_does(report):
    for task, entry in report["tasks"].items():
        full = entry["strategies"]["full"]["by_budget"]["0.2"]
        assert full["accuracy"] == entry["full_accuracy"]
        assert full["agreement"] == 1.0
        if entry["full_accuracy"] > 0:
            assert full["retention"] == 1.0
        for exact in ("prefix", "kmesh_exact"):
            row = entry["strategies"][exact]["by_budget"]["0.2"]
            # Same kernels on the same tokens, the KV cached instead of computed again: the
            # answers are full prefill's (a float-level difference would need a near-tie).
            assert row["agreement"] == 1.0, (task, exact)
            if KINDS[task] != "free":
                assert row["kl_mean"] < 1e-4, (task, exact)


def test_reuse_computes_fewer_tokens(report):
    strategies = report["tasks"]["record_reading"]["strategies"]

    def computed(label: str) -> float:
        return float(strategies[label]["by_budget"]["0.2"]["computed_tokens"])

    assert computed("prefix") < computed("full")
    for label in ("per_request", "collective", "collective+query"):
        assert computed(label) < computed("full"), label


def test_the_command_refuses_a_selection_that_selects_nothing(tmp_path, capsys):
    argv = ["bench", "tasks", "--engine", "reference", "--selections", "full"]
    assert main([*argv, "--json", str(tmp_path / "out.json")]) == 2
    assert "not a selecting recovery policy" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
