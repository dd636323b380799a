"""The table and the plot of a `kmesh bench lora` result (see bench/lora/run.py for the
accounting)."""

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kmesh.bench.common import report_table

HEADER = (
    "agents",
    "strategy",
    "computed tokens",
    "prefill s",
    "KV/agent MiB",
    "private MiB",
    "KL mean",
    "top-1",
    "greedy@32",
    "identical / refused",
)


def _rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for index, agents in enumerate(result["config"]["agents"]):
        for name, strategy in result["strategies"].items():
            if not strategy["runs"]:
                continue  # not built on this engine (its "not_built" says why)
            run = strategy["runs"][index]
            q = run["quality"]
            if "outputs_identical_to_exact" in run:
                extra = f"identical {run['outputs_identical_to_exact']:.2f}"
            elif "gate_refused" in run:
                extra = f"refused {run['gate_refused']}/{agents}"
            else:
                extra = ""
            rows.append(
                [
                    str(agents),
                    name,
                    str(run["computed_tokens"]),
                    f"{run['prefill_seconds']:.2f}",
                    f"{run['kv_bytes_per_agent'] / 2**20:.2f}",
                    f"{run['kv_bytes_private_per_agent'] / 2**20:.2f}",
                    f"{q['kl_mean']:.3g}",
                    f"{q['top1_agreement']:.3f}",
                    f"{q['greedy_match_32']:.3f}",
                    extra,
                ]
            )
    return rows


def _title(cfg: dict[str, Any]) -> str:
    return (
        f"bench lora ({cfg.get('engine', 'reference')} engine): one "
        f"{cfg['context_tokens']}-token context, one adapter per agent "
        f"(quality against exact; activated against its own full prefill)"
    )


def print_report(result: dict[str, Any], console: Console) -> None:
    console.print(report_table(HEADER, _rows(result), _title(result["config"])))
    for name, strategy in result["strategies"].items():
        if "not_built" in strategy:
            console.print(f"{name}: {strategy['not_built']}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Computed tokens and KV bytes per agent against the agent count, a line per strategy."""
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    tokens_axes, bytes_axes = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    agents = result["config"]["agents"]
    for name, strategy in result["strategies"].items():
        runs = strategy["runs"]
        if not runs:
            continue
        tokens_axes.plot(agents, [r["computed_tokens"] for r in runs], marker="o", label=name)
        bytes_axes.plot(
            agents, [r["kv_bytes_per_agent"] / 2**20 for r in runs], marker="o", label=name
        )
    tokens_axes.set(xlabel="agents", ylabel="computed prompt tokens", title="prefill compute")
    bytes_axes.set(
        xlabel="agents", ylabel="MiB per agent (shared state / agents)", title="KV held per agent"
    )
    sizes = [r["kv_bytes_per_agent"] for s in result["strategies"].values() for r in s["runs"]]
    if max(sizes) > 2 * min(sizes):  # a log axis only for a wide range: a narrow one looks steep
        bytes_axes.set_yscale("log")
    else:
        bytes_axes.set_ylim(0, max(sizes) / 2**20 * 1.15)
    for axes in (tokens_axes, bytes_axes):
        axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
