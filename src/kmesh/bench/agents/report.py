"""The table and the plot of a `kmesh bench agents` report (bench/agents/summary.py: its
fields)."""

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kmesh.bench.common import agents_axis, report_table

HEADER = (
    "strategy",
    "agents",
    "makespan s",
    "/ vllm",
    "TTFT p50 / p99 s",
    "CPU s",
    "computed tokens per round",
    "last round computed / new",
    "masters per round",
    "identical to vllm",
    "failures",
)
# The tasks workload's columns, after HEADER's (bench/agents/task_scores.py).
TASK_HEADER = ("task accuracy", "retention [95% CI]", "agreement with vllm")


def _title(cfg: dict[str, Any]) -> str:
    return (
        f"bench agents: {cfg['workload']}, {cfg['rounds']} rounds, {cfg['max_tokens']} greedy "
        f"tokens per message, engine {_engine(cfg)}, KV cache {cfg['kv_cache']}, all of a "
        f"round's agents at once (closed loop); SLO: TTFT p99 <= {cfg['slo_ttft_s']:g} s"
    )


def _engine(cfg: dict[str, Any]) -> str:
    if cfg["engine"] != "vllm":
        return str(cfg["engine"])
    return f"vllm in {cfg['dtype']}"


def _header(cfg: dict[str, Any]) -> tuple[str, ...]:
    return HEADER + TASK_HEADER if cfg["workload"] == "tasks" else HEADER


def _rows(strategies: dict[str, Any], cfg: dict[str, Any]) -> list[list[str]]:
    """A row per strategy and agent count, in `_header(cfg)`'s order."""
    return [
        [
            name,
            n,
            f"{f['makespan_s']:.1f}",
            f"{f['over_vllm']:.2f}",
            f"{f['ttft_p50_s']:.2f} / {f['ttft_p99_s']:.2f}",
            f"{f['cpu_s_total']:.0f}",
            " / ".join(f"{c:.0f}" for c in f["computed_tokens"]),
            _number(f["last_round_computed_over_new"]),
            " / ".join("-" if m is None else f"{m:.0f}" for m in f["masters_built"]),
            " / ".join(f"{s:.2f}" for s in f["identical_to_vllm"]),
            str(len(f["failures"])),
            *(_task_cells(f) if cfg["workload"] == "tasks" else ()),
        ]
        for name, run in strategies.items()
        for n, f in run["by_agents"].items()
    ]


def _task_cells(f: dict[str, Any]) -> tuple[str, str, str]:
    interval = f["task_retention_ci"]
    ci = "" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]"
    return (
        f"{f['task_accuracy']:.2f} of {f['task_items']}",
        _number(f["task_retention"]) + ci,
        f"{f['task_agreement']:.2f}",
    )


def print_report(result: dict[str, Any], console: Console) -> None:
    strategies, cfg = result["strategies"], result["config"]
    console.print(report_table(_header(cfg), _rows(strategies, cfg), _title(cfg)))
    held = ", ".join(f"{name} {run['max_agents_under_slo']}" for name, run in strategies.items())
    console.print(f"agents held under the SLO: {held}")
    if result["config"]["repeats"] > 1:
        console.print("medians over the passes; each pass's makespan s (/ vllm):")
        for name, run in strategies.items():
            for n, f in run["by_agents"].items():
                passes = zip(f["repeats"]["makespan_s"], f["repeats"]["over_vllm"], strict=True)
                each = ", ".join(f"{m:.1f} ({r:.2f})" for m, r in passes)
                console.print(f"  {name}, {n} agents: {each}")
    for name, run in strategies.items():
        for n, f in run["by_agents"].items():
            check = f.get("serial_check")
            if check is not None:
                console.print(
                    f"{name}, {n} agents, sent again one at a time: "
                    f"{check['calls'] - len(check['different'])} of {check['calls']} identical"
                )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(result: dict[str, Any], path: Path) -> None:
    """Agents on x; the run's makespan and its TTFT p99 (log scale) per strategy (medians over
    passes), the SLO dashed."""
    cfg = result["config"]
    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)
    makespan, ttft = figure.subplots(1, 2)
    counts_run: set[int] = set()
    for name, run in result["strategies"].items():
        counts = [int(n) for n in run["by_agents"]]
        counts_run.update(counts)
        figures = list(run["by_agents"].values())
        makespan.plot(counts, [f["makespan_s"] for f in figures], marker="o", label=name)
        ttft.plot(counts, [f["ttft_p99_s"] for f in figures], marker="o", label=name)
    ttft.axhline(cfg["slo_ttft_s"], linestyle="--", color="grey", label="SLO")
    ttft.set_yscale("log")  # p99s span 1-150 s; the SLO's crossing stays readable
    for axes, label in ((makespan, "makespan of all rounds (s)"), (ttft, "TTFT p99 (s)")):
        agents_axis(axes, counts_run)
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(
        f"kmesh bench agents: {cfg['workload']}, {cfg['rounds']} rounds, engine {_engine(cfg)}"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
