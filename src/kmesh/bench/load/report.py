"""The table and the plot of a `kmesh bench load` result (bench/load/run.py says what is
measured)."""

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kmesh.bench.common import report_table

HEADER = (
    "requests",
    "failures",
    "exact checked / wrong",
    "first token p50 / p99 (s)",
    "total p50 / p99 (s)",
    "RSS first / last (MiB)",
    "RSS slope (MiB/min)",
    "store slope (MiB/min)",
)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _row(result: dict[str, Any]) -> list[str]:
    """The soak's one row, in HEADER's order."""
    failures = ", ".join(f"{k} {v}" for k, v in result["failures"].items()) or "none"
    latency, rss = result["latency_s"], result["rss_mib"]
    return [
        str(result["requests"]),
        failures,
        f"{result['checked_exact']} / {result['wrong_exact']}",
        f"{_s(latency['first_token_p50'])} / {_s(latency['first_token_p99'])}",
        f"{_s(latency['total_p50'])} / {_s(latency['total_p99'])}",
        f"{rss[0]['rss_mib']:.0f} / {rss[-1]['rss_mib']:.0f}",
        f"{result['rss_slope_mib_per_min']:.2f}",
        f"{result['store_slope_mib_per_min']:.2f}",
    ]


def print_report(result: dict[str, Any], console: Console) -> None:
    cfg = result["config"]
    title = (
        f"bench load: kmesh serve --engine {cfg['engine']}, {cfg['clients']} clients, "
        f"{cfg['seconds']:.0f} s (seed {cfg['seed']}); slopes after warm-up"
    )
    console.print(report_table(HEADER, [_row(result)], title))
    console.print("by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(result["by_kind"].items())))
    abandoned = result["abandoned"]
    if abandoned:
        first, last = abandoned["rss_mib"][0], abandoned["rss_mib"][-1]
        console.print(
            f"abandoned: {abandoned['opened']} families and rounds opened, never closed; RSS "
            f"{first['rss_mib']:.0f} -> {last['rss_mib']:.0f} MiB; failures "
            f"{abandoned['failures'] or 'none'}"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    """Server RSS and store bytes over the soak; RSS against families opened, if any."""
    abandoned = result["abandoned"]
    figure = Figure(figsize=(11 if abandoned else 6, 4))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2 if abandoned else 1, squeeze=False)[0]
    samples = result["rss_mib"]
    minutes = [s["t"] / 60 for s in samples]
    axes[0].plot(minutes, [s["rss_mib"] for s in samples], label="server RSS (with children)")
    axes[0].plot(minutes, [s["store_mib"] for s in samples], label="store bytes")
    axes[0].set_xlabel("minutes")
    axes[0].set_ylabel("MiB")
    axes[0].set_ylim(bottom=0)
    cfg = result["config"]
    axes[0].set_title(f"{cfg['engine']}: {cfg['clients']} clients, {result['requests']} requests")
    axes[0].legend()
    if abandoned:
        points = abandoned["rss_mib"]
        axes[1].plot([p["opened"] for p in points], [p["rss_mib"] for p in points], marker=".")
        axes[1].set_xlabel("families and rounds opened and abandoned")
        axes[1].set_ylabel("server RSS (MiB)")
        axes[1].set_ylim(bottom=0)
        axes[1].set_title("abandoned state")
    figure.tight_layout()
    figure.savefig(path)
