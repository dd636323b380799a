"""The task bench's table and plot: per task, each strategy at each budget against full prefill."""

from pathlib import Path
from typing import Any


def print_tasks(report: dict[str, Any], console: Any) -> None:
    """One table per task: strategy and budget, accuracy, retention [95% interval], agreement,
    KL, token agreement, computed tokens and seconds (exact strategies once)."""
    from rich.table import Table

    for task, entry in report["tasks"].items():
        gate = "passes" if entry["gated"] else "fails"
        table = Table(
            title=f"{task}: full prefill {entry['full_accuracy']:.3f} ({gate} the gate), "
            f"{entry['items']} items"
        )
        for column in (
            "strategy", "budget", "accuracy", "retention [95%]", "agreement", "KL",
            "token agr.", "computed", "seconds",
        ):  # fmt: skip
            table.add_column(column, justify="left" if column == "strategy" else "right")
        for label, strategy in entry["strategies"].items():
            budgets = strategy["by_budget"]
            for b, row in (
                budgets.items() if strategy["budget_applies"] else [next(iter(budgets.items()))]
            ):
                ci = row["retention_ci"]
                retention = "-" if row["retention"] is None else f"{row['retention']:.3f}"
                if ci is not None:
                    retention += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
                table.add_row(
                    label,
                    b if strategy["budget_applies"] else "exact",
                    f"{row['accuracy']:.3f}",
                    retention,
                    f"{row['agreement']:.3f}",
                    "-" if row["kl_mean"] is None else f"{row['kl_mean']:.4f}",
                    "-" if row["token_agreement"] is None else f"{row['token_agreement']:.3f}",
                    f"{row['computed_tokens']:.0f}",
                    f"{row['seconds']:.2f}",
                )
        console.print(table)


def plot_tasks(report: dict[str, Any], path: Path) -> None:
    """Retention against computed tokens, one panel per task that passes the gate (every task
    when none does), one line per approximate strategy over its budgets, exact strategies as
    points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t, e in report["tasks"].items() if e["gated"]] or list(report["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for label, strategy in report["tasks"][task]["strategies"].items():
            rows = list(strategy["by_budget"].values())
            xs = [r["computed_tokens"] for r in rows]
            ys = [r["retention"] if r["retention"] is not None else float("nan") for r in rows]
            if strategy["budget_applies"]:
                ax.plot(xs, ys, marker="o", label=label)
            else:
                ax.scatter(xs[:1], ys[:1], marker="s", label=label)
        ax.axhline(0.97, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{task} (full prefill {report['tasks'][task]['full_accuracy']:.2f})")
        ax.set_xlabel("computed prompt tokens")
        ax.set_ylabel("retention of full prefill's accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
