"""The table and the plot of a `kmesh bench capacity` result (bench/capacity/run.py says what is
measured)."""

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kmesh.bench.common import agents_axis, report_table

HEADER = (
    "strategy",
    "agents",
    "computed tokens per round",
    "new tokens per round",
    "worst round / new",
    "prefill s per round",
    "held MiB per agent",
    "restored MiB",
)


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _per_round(values: list[float]) -> str:
    return " / ".join(f"{v:,.0f}" for v in values)


def _rows(strategies: dict[str, Any]) -> list[list[str]]:
    """A row per strategy and agent count (one for a strategy that did not run), in HEADER's
    order."""
    rows = []
    for name, strategy in strategies.items():
        if "error" in strategy:
            rows.append([name, "-", f"did not run: {strategy['error'][:90]}", *["-"] * 5])
            continue
        for run in strategy["runs"]:
            computed, new = run["computed_tokens_per_round"], run["new_tokens_per_round"]
            worst = max(c / n for c, n in zip(computed, new, strict=True))
            rows.append(
                [
                    name,
                    str(run["agents"]),
                    _per_round(computed),
                    _per_round(new),
                    f"{worst:.2f}",
                    " / ".join(f"{s:.1f}" for s in run["prefill_seconds_per_round"]),
                    _mib(run["bytes_per_agent"]),
                    _mib(run["bytes_restored"]),
                ]
            )
    return rows


def print_report(result: dict[str, Any], console: Console) -> None:
    cfg = result["config"]
    title = (
        f"bench capacity: {cfg['workload']}, {cfg['rounds']} rounds, budget "
        f"{cfg['budget_mib']} MiB (seed {cfg['seed']}); limit {result['limit']}x new tokens"
    )
    console.print(report_table(HEADER, _rows(result["strategies"]), title))
    console.print(
        "max agents within the limit: "
        + ", ".join(f"{n} {a if a is not None else '-'}" for n, a in result["max_agents"].items())
    )
    console.print(
        "max agents within 2x of the same strategy with unlimited memory: "
        + ", ".join(
            f"{n} {a if a is not None else '-'}" for n, a in result["capacity_agents"].items()
        )
    )
    for name in ("kmesh_dense", "kmesh"):
        runs = result["strategies"].get(name, {}).get("runs", [])
        for run in runs:
            if "transcript_bytes_per_agent" in run:
                console.print(
                    f"{name} at {run['agents']} agents: transcript "
                    f"{_mib(run['transcript_bytes_per_agent'])} MiB per agent (trunk and masters "
                    f"counted once), its own pieces {_mib(run['own_bytes_per_agent'])} MiB, dense "
                    f"{_mib(run['dense_bytes_per_agent'])} MiB; {run['restores_checked']} pieces "
                    f"restored bit-identically, {run['pieces_lost']} lost"
                )


def plot(result: dict[str, Any], path: Path) -> None:
    """Agents on x, computed tokens per round (the mean over rounds after the first) on y, one
    line per strategy, and the new tokens with the limit."""
    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    reference = None
    for name, strategy in result["strategies"].items():
        runs = strategy.get("runs", [])
        if not runs:
            continue
        agents = [run["agents"] for run in runs]
        axes.plot(
            agents, [_later_mean(r["computed_tokens_per_round"]) for r in runs], "o-", label=name
        )
        reference = runs
    if reference is not None:
        agents = [run["agents"] for run in reference]
        new = [_later_mean(r["new_tokens_per_round"]) for r in reference]
        axes.plot(agents, new, "k--", label="new tokens of the round")
        axes.plot(agents, [result["limit"] * n for n in new], "k:", label=f"{result['limit']}x new")
    cfg = result["config"]
    agents_axis(
        axes, (r["agents"] for s in result["strategies"].values() for r in s.get("runs", []))
    )
    axes.set_yscale("log")
    axes.set_ylabel("computed tokens per round (rounds 2..R, mean)")
    axes.set_title(f"{cfg['workload']}: budget {cfg['budget_mib']} MiB for every strategy")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def _later_mean(values: list[float]) -> float:
    later = values[1:] or values
    return sum(later) / len(later)
