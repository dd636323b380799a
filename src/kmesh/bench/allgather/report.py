"""Tables, a markdown report and plots for a `kmesh bench allgather` result.

The result is the benchmark's JSON-ready dict: hardware, note, config, the four strategies (full,
prefix, per_request, collective) with their compute, storage and quality against full, the
comparison ratios, and optionally a sweep over recompute ratios and a scaling run over agent
counts. Every table is built once as rows of strings and rendered both with rich (the console)
and as markdown (report.md).
"""

from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Column, Table

from kmesh.bench.allgather.frontier_report import FRONTIER_HEADER, below_lines, frontier_rows
from kmesh.bench.common import report_table

KL_FLOOR = 1e-6  # where a zero KL is drawn on the log-scale quality plot

TOKEN_LAYERS = (
    "computed tokens counts token-layers computed divided by the number of layers: a token "
    "computed through 2 of 30 layers counts 2/30."
)

STRATEGY_HEADER = (
    "strategy",
    "computed tokens",
    "prefill s",
    "KV/agent KiB",
    "KL mean",
    "KL p95",
    "top-1",
    "greedy@32",
    "fallbacks",
)
SWEEP_HEADER = (
    "policy",
    "ratio",
    "strategy",
    "computed",
    "KL mean",
    "KL p95",
    "top-1",
    "greedy@32",
)
COMPARISON_LABELS = {
    "computed_collective_over_per_request": "computed tokens, collective / per_request",
    "seconds_collective_over_per_request": "prefill seconds, collective / per_request",
    "computed_collective_over_prefix": "computed tokens, collective / prefix",
    "kv_dense_over_collective": "KV bytes, dense / collective",
    "kv_dense_over_mirror": "KV bytes, dense / collective mirror",
}

Rows = list[list[str]]


def _kib(n_bytes: float) -> str:
    return f"{n_bytes / 1024:.1f}"


def _quality_cells(quality: dict[str, Any]) -> list[str]:
    return [
        f"{quality['kl_mean']:.3g}",
        f"{quality['kl_p95']:.3g}",
        f"{quality['top1_agreement']:.3f}",
        f"{quality['greedy_match_32']:.3f}",
    ]


def _title(result: dict[str, Any]) -> str:
    cfg = result["config"]
    return (
        f"bench allgather: {cfg['agents']} agents, {cfg['rounds']} rounds, order {cfg['order']}, "
        f"policy {cfg['policy']}, recompute ratio {cfg['recompute_ratio']}"
    )


def _strategy_rows(result: dict[str, Any]) -> Rows:
    return [
        [
            name,
            f"{row['computed_tokens']:.1f}",
            f"{row['prefill_seconds']:.2f}",
            _kib(row["kv_bytes_per_agent"]),
            *_quality_cells(row["quality"]),
            str(row["fallbacks"]),
        ]
        for name, row in result["strategies"].items()
    ]


def _collective_line(result: dict[str, Any]) -> str:
    collective = result["strategies"]["collective"]
    identical = collective.get("restore_bit_identical")
    restore = (
        "mirrors held densely in vLLM's pages"
        if identical is None
        else f"restore bit-identical: {'yes' if identical else 'NO'}"
    )
    return (
        f"collective KV: master {_kib(collective['kv_bytes_master'])} KiB, mirror "
        f"{_kib(collective['kv_bytes_mirror_per_agent'])} KiB per agent; {restore}"
    )


def _comparison_items(result: dict[str, Any]) -> list[str]:
    items = []
    for key, value in result["comparison"].items():
        if key == "last_round_computed_over_new":
            per = ", ".join(f"{name} {ratio:.2f}" for name, ratio in value.items())
            items.append(f"last round's computed tokens / its new tokens: {per}")
        elif value is not None:
            items.append(f"{COMPARISON_LABELS.get(key, key)}: {value:.2f}")
    return items


CLOSED_LOOP_HEADER = ("strategy", "identical to full, per round", "common prefix, per round")


def _closed_loop_rows(result: dict[str, Any]) -> Rows:
    return [
        [
            name,
            " / ".join(f"{x:.3f}" for x in run["closed_loop"]["identical_share_per_round"]),
            " / ".join(f"{x:.3f}" for x in run["closed_loop"]["common_prefix_mean_per_round"]),
        ]
        for name, run in result["strategies"].items()
        if "closed_loop" in run
    ]


SWEEP_LEGEND = (
    "The ratio is per_request's recompute ratio (per agent); collective's agent ratio (each "
    "agent's blocks recomputed, the master as configured); collective_shared's shared ratio "
    "(the common-context master: the round's outputs recovered once from their stored KV, no "
    "per-agent correction)."
)


def _sweep_rows(sweep: list[dict[str, Any]]) -> Rows:
    return [
        [
            point["policy"],
            f"{point['ratio']:g}",
            point["strategy"],
            f"{point['computed_tokens']:.1f}",
            *_quality_cells(point["quality"]),
        ]
        for point in sweep
    ]


def _scaling_table(scaling: list[dict[str, Any]]) -> tuple[list[str], Rows]:
    names = list(scaling[0]["strategies"])
    header = ["agents"]
    for name in names:
        header += [f"{name} tokens", f"{name} s"]
    header += ["KV dense/collective", "KV dense/mirror"]
    rows = []
    for point in scaling:
        row = [str(point["agents"])]
        for name in names:
            run = point["strategies"][name]
            row += [f"{run['computed_tokens']:.1f}", f"{run['prefill_seconds']:.2f}"]
        row += [f"{point['kv_dense_over_collective']:.2f}", f"{point['kv_dense_over_mirror']:.2f}"]
        rows.append(row)
    return header, rows


def _rich_table(header: list[str] | tuple[str, ...], rows: Rows, title: str) -> Table:
    """`report_table` with the first column (the row's name) kept on one line."""
    first, *rest = header
    return report_table((Column(first, no_wrap=True), *rest), rows, title)


def print_table(result: dict[str, Any], console: Console) -> None:
    """The strategies table, the comparison ratios, then the sweep, scaling, closed-loop and
    frontier tables if any."""
    console.print(_rich_table(STRATEGY_HEADER, _strategy_rows(result), _title(result)))
    console.print(_collective_line(result))
    console.print("\n".join(_comparison_items(result)))
    if sweep := result.get("sweep"):
        console.print(_rich_table(SWEEP_HEADER, _sweep_rows(sweep), "quality vs recompute ratio"))
    if scaling := result.get("scaling"):
        header, rows = _scaling_table(scaling)
        console.print(_rich_table(header, rows, "scaling over agent counts"))
    if closed := _closed_loop_rows(result):
        console.print(_rich_table(CLOSED_LOOP_HEADER, closed, "closed loop vs full prefill's"))
    if frontier := result.get("frontier"):
        title = "frontier sweep (* on its strategy's frontier)"
        console.print(_rich_table(FRONTIER_HEADER, frontier_rows(frontier), title))
        console.print("\n".join(below_lines(frontier)))


def _markdown_table(header: list[str] | tuple[str, ...], rows: Rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _figure(panels: int) -> tuple[Figure, list[Any]]:
    """A figure on the Agg canvas, outside pyplot: nothing global to select or close."""
    figure = Figure(figsize=(6 * panels, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, [figure.add_subplot(1, panels, i + 1) for i in range(panels)]


def _plot_quality_vs_ratio(sweep: list[dict[str, Any]], path: Path) -> None:
    lines: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
    for point in sweep:
        quality = point["quality"]
        lines[(point["policy"], point["strategy"])].append(
            (point["ratio"], max(quality["kl_mean"], KL_FLOOR), quality["greedy_match_32"])
        )
    figure, (kl_axes, greedy_axes) = _figure(2)
    # Colour by policy, line style by strategy (lines may overlap).
    policies = sorted({policy for policy, _ in lines})
    styles = ["-", "--", ":", "-."]
    strategies = sorted({strategy for _, strategy in lines})
    for (policy, strategy), points in lines.items():
        ratios, kls, greedy = zip(*sorted(points), strict=True)
        style = {
            "label": f"{policy} / {strategy}",
            "marker": "o",
            "color": f"C{policies.index(policy)}",
            "linestyle": styles[strategies.index(strategy) % len(styles)],
        }
        kl_axes.plot(ratios, kls, **style)
        greedy_axes.plot(ratios, greedy, **style)
    kl_axes.set_yscale("log")
    kl_axes.set_xlabel("recompute ratio")
    kl_axes.set_ylabel(f"next-token KL mean vs full (0 drawn at {KL_FLOOR:g})")
    kl_axes.set_title("KL divergence")
    greedy_axes.set_xlabel("recompute ratio")
    greedy_axes.set_ylabel("greedy match over 32 tokens")
    greedy_axes.set_ylim(0, 1.05)
    greedy_axes.set_title("greedy continuation")
    kl_axes.legend(fontsize="small")
    figure.savefig(path, dpi=100)


def _plot_compute_storage(result: dict[str, Any], path: Path) -> None:
    strategies = result["strategies"]
    names = list(strategies)
    figure, (compute_axes, kv_axes) = _figure(2)
    compute_axes.bar(names, [strategies[n]["computed_tokens"] for n in names], color="tab:blue")
    compute_axes.set_ylabel("computed tokens (token-layers / layers)")
    compute_axes.set_title("prefill compute")
    kv_axes.bar(
        names, [strategies[n]["kv_bytes_per_agent"] / 1024 for n in names], color="tab:green"
    )
    kv_axes.set_ylabel("KV KiB per agent")
    kv_axes.set_title("KV storage")
    collective = strategies["collective"]
    kv_axes.annotate(
        f"master {_kib(collective['kv_bytes_master'])} KiB\n"
        f"mirror {_kib(collective['kv_bytes_mirror_per_agent'])} KiB/agent",
        xy=(names.index("collective"), collective["kv_bytes_per_agent"] / 1024),
        xytext=(0, 4),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize="small",
    )
    figure.savefig(path, dpi=100)


def _plot_scaling(scaling: list[dict[str, Any]], path: Path) -> None:
    agents = [point["agents"] for point in scaling]
    figure, (axes,) = _figure(1)
    for name in scaling[0]["strategies"]:
        tokens = [point["strategies"][name]["computed_tokens"] for point in scaling]
        axes.plot(agents, tokens, marker="o", label=name)
    axes.set_xlabel("agents")
    axes.set_ylabel("computed tokens (token-layers / layers)")
    axes.set_title("prefill compute vs agent count")
    axes.legend()
    figure.savefig(path, dpi=100)


def write_report(result: dict[str, Any], out_dir: Path) -> Path:
    """Write report.md and its PNG plots into out_dir (created); return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = "\n".join(f"- {key}: {value}" for key, value in result["config"].items())
    comparison = "\n".join(f"- {item}" for item in _comparison_items(result))
    _plot_compute_storage(result, out_dir / "compute_storage.png")
    sections = [
        "# kmesh bench allgather",
        f"Hardware: {result['hardware']}",
        f"> {result['note']}",
        f"## Configuration\n\n{config}",
        f"## Strategies\n\n{_title(result)}. {TOKEN_LAYERS}",
        _markdown_table(STRATEGY_HEADER, _strategy_rows(result)),
        _collective_line(result),
        "![computed tokens and KV bytes per strategy](compute_storage.png)",
        f"## Comparison\n\n{comparison}",
    ]
    if sweep := result.get("sweep"):
        _plot_quality_vs_ratio(sweep, out_dir / "quality_vs_ratio.png")
        sections += [
            "## Quality vs recompute ratio",
            SWEEP_LEGEND,
            _markdown_table(SWEEP_HEADER, _sweep_rows(sweep)),
            "![KL mean and greedy match vs recompute ratio](quality_vs_ratio.png)",
        ]
    if scaling := result.get("scaling"):
        _plot_scaling(scaling, out_dir / "scaling.png")
        sections += [
            "## Scaling over agent counts",
            _markdown_table(*_scaling_table(scaling)),
            "![computed tokens vs agents](scaling.png)",
        ]
    if closed := _closed_loop_rows(result):
        sections += [
            "## Closed loop (each strategy on its own outputs) vs full prefill's",
            _markdown_table(CLOSED_LOOP_HEADER, closed),
        ]
    path = out_dir / "report.md"
    path.write_text("\n\n".join(sections) + "\n")
    return path
