"""The frontier sweep: its arithmetic (axes, Pareto frontier, where collective is below), its
runner on fake measurements, and one tiny run through the reference engine with the table and
the plot."""

import json

import pytest

from kmesh.bench.allgather.closed_loop import reference_closed_loop
from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.frontier import (
    ANCHORS,
    POINTS,
    Point,
    axes,
    calibration_rows,
    collective_below,
    frontier_loops,
    frontier_report,
    pareto,
    run_frontier,
)
from kmesh.bench.allgather.frontier_report import below_lines, frontier_rows, plot_frontier
from kmesh.bench.allgather.run import AllGatherBench
from kmesh.engine.engine import Engine
from tests.bench.allgather.test_closed_loop import WORKLOAD, ByteTokenizer
from tests.cli.test_cli import kmesh_in_process
from tests.conftest import synthetic_allgather_turns


def loop(tokens: list[float], shares: list[float]) -> dict[str, list[float]]:
    return {
        "identical_share_per_round": shares,
        "common_prefix_mean_per_round": shares,
        "computed_tokens_per_round": tokens,
    }


def row(label: str, strategy: str, tokens: float, identical: float) -> dict:
    return {
        "label": label,
        "strategy": strategy,
        "closed_loop_tokens": tokens,
        "closed_loop_identical": identical,
    }


def test_a_loops_place_is_its_tokens_and_its_share_over_the_rounds_that_hold_outputs():
    assert axes(loop([100, 50, 50.04], [1.0, 0.5, 0.25])) == (200.0, 0.375)
    assert axes(loop([7], [0.5])) == (7.0, 0.5)  # one round: that round


def test_the_frontier_keeps_only_points_nothing_else_dominates():
    rows = [
        row("a", "s", 100, 0.2),
        row("b", "s", 200, 0.2),  # more tokens, no better: dominated by a
        row("c", "s", 150, 0.6),
        row("d", "s", 150, 0.5),  # same tokens as c, worse
        row("e", "s", 400, 1.0),
    ]
    assert pareto(rows) == ["a", "c", "e"]


def test_collective_is_below_where_a_per_request_point_beats_its_best_at_no_more_tokens():
    per_request = [row("p1", "per_request", 100, 0.3), row("p2", "per_request", 300, 0.8)]
    collective = [row("c1", "collective", 90, 0.5), row("c2", "collective", 350, 0.9)]
    [below] = collective_below(per_request, collective)
    assert below["per_request"] == "p2" and below["collective_best_identical"] == 0.5
    early = [row("p0", "per_request", 50, 0.1)]
    assert collective_below(early, collective)[0]["collective_best_identical"] is None
    assert collective_below(per_request[:1], collective) == []


def test_the_report_has_points_anchors_frontiers_and_the_comparison():
    rows = [
        {
            "label": "per_request@r=0.3",
            "strategy": "per_request",
            "closed_loop": loop([10, 20], [1, 0.5]),
        },
        {
            "label": "collective@r=0",
            "strategy": "collective",
            "closed_loop": loop([10, 5], [1, 0.75]),
        },
    ]
    report = frontier_report(rows, {"full": loop([10, 40], [1, 1])})
    assert report["frontiers"] == {
        "collective": ["collective@r=0"],
        "per_request": ["per_request@r=0.3"],
    }
    assert report["collective_below_per_request"] == []
    assert report["anchors"]["full"]["tokens"] == 50 and report["anchors"]["full"]["identical"] == 1
    assert rows[1]["closed_loop_tokens"] == 15 and rows[1]["closed_loop_identical"] == 0.75


def test_the_grid_sets_each_points_knobs_and_every_label_is_its_own():
    labels = [p.label for p in POINTS]
    assert len(set(labels)) == len(labels)
    assert {p.strategy for p in POINTS} == {"per_request", "collective"}
    base = AllGatherBenchConfig()
    for point in POINTS:
        cfg = point.config(base)
        for knob, value in point.knobs:
            assert getattr(cfg, knob) == value, point.label
    loops = frontier_loops(base)
    assert list(loops)[: len(ANCHORS)] == list(ANCHORS) and len(loops) == len(ANCHORS) + len(POINTS)


def test_the_runner_measures_each_point_under_its_own_settings():
    points = [
        Point("per_request", (("recompute_ratio", 0.5),)),
        Point("collective", (("agent_ratio", 0.25),)),
    ]
    seen = []

    def open_loop(label, name, cfg):
        seen.append((label, name, cfg.recompute_ratio, cfg.agent_ratio))
        return {"computed_tokens": 1.0, "quality": {"kl_mean": 0.0}}

    def closed_loops(loops):
        assert loops["per_request@recompute_ratio=0.5"][1].recompute_ratio == 0.5
        return {label: loop([1, 2], [1, 1]) for label in loops}

    report = run_frontier(AllGatherBenchConfig(), open_loop, closed_loops, points=points)
    assert seen == [
        ("per_request@recompute_ratio=0.5", "per_request", 0.5, 0.0),
        ("collective@agent_ratio=0.25", "collective", 0.3, 0.25),
    ]
    assert set(report["anchors"]) == set(ANCHORS)
    assert [p["closed_loop_tokens"] for p in report["points"]] == [3.0, 3.0]


@pytest.fixture(scope="module")
def tiny_frontier(tiny):
    """Per_request and collective at nothing recomputed and at everything recomputed, on the
    tiny model (random weights: no gate)."""
    executor, fingerprint = tiny
    turns = synthetic_allgather_turns(agents=3, rounds=2)
    cfg = AllGatherBenchConfig(block_size=4, greedy_tokens=4, gate=None, policy="full")
    bench = AllGatherBench(executor, fingerprint, turns, cfg)
    points = [
        Point("per_request", (("policy", "none"), ("recompute_ratio", 0.0))),
        Point("per_request", (("recompute_ratio", 1.0),)),
        Point("collective", (("agent_ratio", 1.0),)),
    ]

    def closed_loops(loops):
        return reference_closed_loop(
            Engine(executor, fingerprint), ByteTokenizer(), WORKLOAD, loops
        )

    report = run_frontier(
        cfg,
        lambda _, name, point: bench.summary(bench.run_at(name, point)),
        closed_loops,
        points=points,
    )
    return {"config": {"agents": 3, "rounds": 2}, "frontier": report}


def test_exact_points_close_the_loop_like_full_prefill_and_cost_more(tiny_frontier):
    points = {p["label"]: p for p in tiny_frontier["frontier"]["points"]}
    exact = points["per_request@recompute_ratio=1.0"]
    reused = points["per_request@policy=none,recompute_ratio=0.0"]
    assert exact["closed_loop_identical"] == 1.0
    assert points["collective@agent_ratio=1.0"]["closed_loop_identical"] == 1.0
    assert reused["closed_loop_tokens"] < exact["closed_loop_tokens"]
    assert reused["computed_tokens"] < exact["computed_tokens"]
    assert exact["quality"]["kl_mean"] < 1e-6
    # The cheapest point is always on its strategy's frontier.
    assert tiny_frontier["frontier"]["frontiers"]["per_request"][0] == reused["label"]


def test_the_table_and_the_plot(tiny_frontier, tmp_path):
    rows = frontier_rows(tiny_frontier["frontier"])
    assert [r[0] for r in rows[:2]] == list(ANCHORS)
    assert any(r[0].endswith(" *") for r in rows)
    assert below_lines(tiny_frontier["frontier"])
    plot_frontier(tiny_frontier, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 0


def frontier_of(points: dict[str, tuple[float, list[float], float]], prefix: float) -> dict:
    """A report's frontier: per label (KL p95, identical share per round, closed-loop tokens)."""
    rows = [
        {
            "label": label,
            "strategy": label.split("@")[0],
            "knobs": {},
            "quality": {"kl_p95": kl},
            "closed_loop": loop([tokens, 0.0], shares),
        }
        for label, (kl, shares, tokens) in points.items()
    ]
    return frontier_report(rows, {"prefix": loop([prefix, 0.0], [1.0, 1.0])})


def test_a_calibration_keeps_each_settings_worst_figures_over_the_traces():
    one = frontier_of({"c@a": (0.02, [1.0, 0.9], 50), "c@b": (0.1, [1.0, 0.5], 20)}, 100)
    two = frontier_of({"c@a": (0.03, [1.0, 0.8], 60), "c@gone": (0.0, [1.0, 1.0], 1)}, 120)
    [row] = calibration_rows([one, two])  # c@b and c@gone were not measured on both traces
    assert row["label"] == "c@a" and row["kl_p95"] == 0.03
    assert row["identical_min"] == 0.8 and row["tokens_over_prefix"] == 0.5  # max(50/100, 60/120)


def test_the_calibrate_command_prints_and_writes_the_worst_figures(tmp_path, capsys):
    paths = []
    for i, frontier in enumerate(
        [
            frontier_of({"c@a": (0.02, [1.0, 0.9], 50)}, 100),
            frontier_of({"c@a": (0.04, [1.0, 1.0], 90)}, 100),
        ]
    ):
        path = tmp_path / f"f{i}.json"
        path.write_text(json.dumps({"config": {"model": "m" * 64}, "frontier": frontier}))
        paths.append(str(path))
    out = tmp_path / "calibration.json"
    args = ["bench", "calibrate", "--frontiers", ",".join(paths), "--json", str(out)]
    assert kmesh_in_process(args, capsys) == (0, "")
    [row] = json.loads(out.read_text())["settings"]
    assert (row["kl_p95"], row["identical_min"], row["tokens_over_prefix"]) == (0.04, 0.9, 0.9)
