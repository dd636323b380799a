"""The frontier sweep's table and plot (bench/allgather/frontier.py's `frontier` report, both
engines): a row per point and anchor, the points on their strategy's frontier starred; the plot
puts the closed loop's computed tokens on x and its identical share (rounds >= 1) on y, each
strategy's frontier drawn as a line through its points, the anchors (full, prefix) as crosses."""

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kmesh.bench.common import report_table

FRONTIER_HEADER = (
    "point",
    "open-loop tokens",
    "KL mean",
    "KL p95",
    "greedy@32",
    "closed-loop tokens",
    "identical, per round",
    "identical (rounds >= 1)",
)


def frontier_rows(frontier: dict[str, Any]) -> list[list[str]]:
    on_front = {label for labels in frontier["frontiers"].values() for label in labels}
    rows = []
    for name, loop in frontier["anchors"].items():
        rows.append(
            [name, "-", "-", "-", "-", *_loop_cells(loop, loop["tokens"], loop["identical"])]
        )
    for point in frontier["points"]:
        quality = point["quality"]
        rows.append(
            [
                point["label"] + (" *" if point["label"] in on_front else ""),
                f"{point['computed_tokens']:.1f}",
                f"{quality['kl_mean']:.4f}",
                f"{quality['kl_p95']:.4f}",
                f"{quality['greedy_match_32']:.3f}",
                *_loop_cells(
                    point["closed_loop"],
                    point["closed_loop_tokens"],
                    point["closed_loop_identical"],
                ),
            ]
        )
    return rows


def _loop_cells(loop: dict[str, Any], tokens: float, identical: float) -> list[str]:
    shares = " / ".join(f"{x:.3f}" for x in loop["identical_share_per_round"])
    return [f"{tokens:.1f}", shares, f"{identical:.3f}"]


def below_lines(frontier: dict[str, Any]) -> list[str]:
    """Where collective's frontier is below per_request's, one line each (or that it is not)."""
    below = frontier["collective_below_per_request"]
    if not below:
        return ["collective's frontier is at or above per_request's at every budget swept"]
    return [
        f"below at {b['tokens']:.0f} tokens: per_request {b['per_request']} "
        f"{b['per_request_identical']:.3f}, collective's best with no more tokens "
        + (
            "none"
            if b["collective_best_identical"] is None
            else f"{b['collective_best_identical']:.3f}"
        )
        for b in below
    ]


def plot_frontier(result: dict[str, Any], path: Path) -> None:
    frontier = result["frontier"]
    figure = Figure(figsize=(7.5, 5))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    points = frontier["points"]
    for strategy, labels in frontier["frontiers"].items():
        mine = [p for p in points if p["strategy"] == strategy]
        dots = axes.scatter(
            [p["closed_loop_tokens"] for p in mine],
            [p["closed_loop_identical"] for p in mine],
            alpha=0.45,
        )
        front = [next(p for p in mine if p["label"] == label) for label in labels]
        axes.plot(
            [p["closed_loop_tokens"] for p in front],
            [p["closed_loop_identical"] for p in front],
            marker="o",
            color=dots.get_facecolor()[0],
            label=f"{strategy} (frontier)",
        )
    for name, anchor in frontier["anchors"].items():
        axes.scatter([anchor["tokens"]], [anchor["identical"]], marker="x", s=60, label=name)
    cfg = result["config"]
    axes.set_xlabel("prompt tokens computed, closed loop (all rounds)")
    axes.set_ylabel("outputs identical to full prefill's (rounds >= 1)")
    axes.set_ylim(-0.05, 1.05)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title(
        f"frontier: {cfg['agents']} agents x {cfg['rounds']} rounds, "
        f"engine {cfg.get('engine', 'reference')}",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def print_calibration(result: dict[str, Any], console: Console) -> None:
    """`kmesh bench calibrate`'s table: each setting's worst figures over the traces."""
    rows = [
        [
            s["label"],
            f"{s['kl_p95']:.4f}",
            f"{s['identical_min']:.3f}",
            f"{s['tokens_over_prefix']:.3f}",
        ]
        for s in result["settings"]
    ]
    header = ("setting", "KL p95 (max)", "identical, least round", "tokens / prefix (max)")
    title = f"worst over {len(result['frontiers'])} traces, model {result['model'][:12]}"
    console.print(report_table(header, rows, title))
