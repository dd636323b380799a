"""Whether a signal seen at recovery time predicts that an approximate prefill's greedy output
diverges from full prefill's.

Per prompt of an approximate strategy (rounds >= 1, where outputs are reused), `signal_rows`
keeps:
- `margin`: the recovered state's top-1 margin at the last prompt position (the probability of
  the most likely next token minus the second's): what a runtime sees without a reference;
- `reference_margin`: the same of full prefill's state (only a bench knows it);
- `kl`: the next-token KL(full || recovered);
- `diverged`: the greedy continuation differs from full prefill's in any of its tokens.

A threshold t predicts "diverges" for margin < t. `fit` picks, on some traces, the t with the
best F1 (ties: the smallest t, the fewest prompts sent to recompute); `score` gives its precision
and recall on others. Rows are plain dicts: the bench's JSON carries them, and the fit runs on
JSON files alone (`kmesh bench signals`).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kmesh.bench.quality import next_token_kl

if TYPE_CHECKING:
    from kmesh.bench.allgather_summary import StrategyRun


def top1_margin(logits: torch.Tensor) -> float:
    """Probability of the most likely token minus the second's, for one [vocab] row."""
    top = torch.softmax(logits.to(torch.float64), dim=-1).topk(2).values
    return float(top[0] - top[1])


def signal_rows(run: "StrategyRun", reference: "StrategyRun") -> list[dict[str, Any]]:
    rows = []
    for key in sorted(run.greedy):
        got, want = run.logits[key], reference.logits[key]
        rows.append(
            {
                "round": key[0],
                "agent": key[1],
                "margin": round(top1_margin(got), 6),
                "reference_margin": round(top1_margin(want), 6),
                "kl": round(float(next_token_kl(want[None], got[None])[0]), 6),
                "diverged": run.greedy[key] != reference.greedy[key],
            }
        )
    return rows


@dataclass(frozen=True, slots=True)
class Score:
    threshold: float
    prompts: int
    diverged: int
    predicted: int  # margin < threshold
    caught: int  # predicted and diverged

    @property
    def precision(self) -> float | None:
        return self.caught / self.predicted if self.predicted else None

    @property
    def recall(self) -> float | None:
        return self.caught / self.diverged if self.diverged else None

    @property
    def f1(self) -> float:
        return 2 * self.caught / (self.predicted + self.diverged) if self.caught else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "threshold": round(self.threshold, 6),
            "prompts": self.prompts,
            "diverged": self.diverged,
            "predicted": self.predicted,
            "caught": self.caught,
            "precision": _round(self.precision),
            "recall": _round(self.recall),
        }


def score(rows: Sequence[dict[str, Any]], threshold: float) -> Score:
    predicted = [row["margin"] < threshold for row in rows]
    return Score(
        threshold,
        len(rows),
        sum(row["diverged"] for row in rows),
        sum(predicted),
        sum(p and row["diverged"] for p, row in zip(predicted, rows, strict=True)),
    )


def fit(rows: Sequence[dict[str, Any]]) -> Score:
    """The threshold with the best F1 on `rows` (module docstring); 0 (predict nothing) when no
    row diverged. Candidates sit just above each row's margin."""
    candidates: Iterable[float] = sorted({row["margin"] + 1e-9 for row in rows})
    best = score(rows, 0.0)
    for threshold in candidates:
        candidate = score(rows, threshold)
        if candidate.f1 > best.f1:
            best = candidate
    return best


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def signals_report(
    fit_reports: dict[str, dict[str, Any]],
    test_reports: dict[str, dict[str, Any]],
    strategies: Sequence[str],
) -> dict[str, Any]:
    """The margin threshold fitted on `fit_reports`' prompts and scored on `test_reports`' (All-
    Gather bench JSONs by file name), per strategy and over them all."""

    def rows(reports: dict[str, dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
        found = []
        for path, report in reports.items():
            for name in names:
                signals = report.get("strategies", {}).get(name, {}).get("signals")
                if signals is None:
                    raise ValueError(f"{path} has no signals for {name!r} (an older bench JSON?)")
                found += signals
        return found

    result: dict[str, Any] = {}
    for label, names in [(name, [name]) for name in strategies] + [("all", list(strategies))]:
        fitted = fit(rows(fit_reports, names))
        result[label] = {
            "fit": fitted.as_dict(),
            "test": score(rows(test_reports, names), fitted.threshold).as_dict(),
        }
    return {"fit_on": sorted(fit_reports), "test_on": sorted(test_reports), "margin": result}


def print_signals(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="top-1 margin < threshold predicts a diverging greedy output")
    for column in ("strategy", "threshold", "fit P / R (prompts)", "test P / R (prompts)"):
        table.add_column(column)
    for label, row in report["margin"].items():
        fitted, tested = row["fit"], row["test"]
        table.add_row(
            label,
            f"{fitted['threshold']:.4f}",
            f"{fitted['precision']} / {fitted['recall']} ({fitted['prompts']})",
            f"{tested['precision']} / {tested['recall']} ({tested['prompts']})",
        )
    console.print(table)
