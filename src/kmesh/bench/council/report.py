"""The table and the plot of a `kmesh bench council` result (bench/council/run.py: the
accounting)."""

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kmesh.bench.common import report_table

HEADER = (
    "setting",
    "round",
    "prompt tokens",
    "vanilla computed",
    "kmesh computed",
    "kmesh / vanilla",
    "kmesh reused / recovered",
    "fallbacks",
    "identical to vanilla",
)


def _totals(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rounds) for k in rounds[0]}


def _title(cfg: dict[str, Any]) -> str:
    return (
        f"bench council: {cfg['framework']} RoundRobinGroupChat, {cfg['agents']} agents x "
        f"{cfg['rounds']} rounds, {cfg['max_tokens']} greedy tokens per message; vanilla "
        f"vLLM vs kmesh serve --engine {cfg['engine']} --reuse-messages (approximate; "
        "identical: closed loop)"
    )


def _rows(result: dict[str, Any]) -> list[list[str]]:
    """Per KMesh setting (a ratio or a quality target), a row per round and one for all rounds,
    in HEADER's order."""
    vanilla = result["vanilla"]["rounds"]
    rows = []
    for run in result["kmesh"]:
        rounds = list(zip(vanilla, run["rounds"], run["identical_to_vanilla"], strict=True))
        labelled = [(str(i), *round_) for i, round_ in enumerate(rounds)]
        labelled.append(("all", _totals(vanilla), _totals(run["rounds"]), None))
        rows += [
            [
                run["setting"],
                label,
                f"{ours['prompt']:.0f}",
                f"{base['computed']:.0f}",
                f"{ours['computed']:.1f}",
                f"{ours['computed'] / max(base['computed'], 1):.2f}",
                f"{ours['reused']:.0f} / {ours['recovered']:.0f}",
                f"{ours['fallbacks']:.0f}",
                "" if same is None else f"{same:.2f}",
            ]
            for label, base, ours, same in labelled
        ]
    return rows


def print_report(result: dict[str, Any], console: Console) -> None:
    console.print(report_table(HEADER, _rows(result), _title(result["config"])))


def plot(result: dict[str, Any], path: Path) -> None:
    """Computed prompt tokens per round: vanilla vLLM beside KMesh at each setting."""
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    sides = [("vanilla vLLM", result["vanilla"]["rounds"])]
    sides += [(f"KMesh, {run['setting']}", run["rounds"]) for run in result["kmesh"]]
    rounds = range(len(sides[0][1]))
    width = 0.8 / len(sides)
    for i, (label, counters) in enumerate(sides):
        offset = (i - (len(sides) - 1) / 2) * width
        axes.bar(
            [x + offset for x in rounds], [c["computed"] for c in counters], width, label=label
        )
    prompt = [c["prompt"] for c in result["vanilla"]["rounds"]]
    axes.plot(list(rounds), prompt, "k--", marker="o", label="prompt tokens (vanilla)")
    axes.set(
        xlabel="round",
        ylabel="tokens",
        xticks=list(rounds),
        title=f"{result['config']['framework']} council: computed prompt tokens per round",
    )
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
