"""Whether a signal seen at recovery time predicts that an approximate prefill's greedy output
diverges from full prefill's.

Per prompt of an approximate strategy (rounds >= 1, where outputs are reused), a row
(bench/allgather/summary.py::signal_rows) keeps:
- `margin`: the recovered state's top-1 margin at the last prompt position (the probability of
  the most likely next token minus the second's): what a runtime sees without a reference;
- `reference_margin`: the same of full prefill's state (only a bench knows it);
- `deviation`: the gate's mean relative key deviation at its check layer, where it checked the
  prompt's region (None elsewhere);
- `attention_mass`, `probe_kl`, `probe_shift`: bench/signals/recovery.py's (the last token's
  attention on reused rows; how the last position moves when the last rows are recomputed);
- `kl`: the next-token KL(full || recovered);
- `diverged`: the greedy continuation differs from full prefill's in any of its tokens.

A threshold t on a signal predicts "diverges" for margin < t, or for any other signal > t.
`fit` picks, on some traces, the t with the best F1 (ties: the t that flags the fewest prompts,
the fewest sent to recompute); `score` gives its precision and recall on others. Rows are plain
dicts: the bench's JSON carries them, and the fit runs on JSON files alone (`kmesh bench
signals`).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def top1_margin(logits: torch.Tensor) -> float:
    """Probability of the most likely token minus the second's, for one [vocab] row."""
    top = torch.softmax(logits.to(torch.float64), dim=-1).topk(2).values
    return float(top[0] - top[1])


@dataclass(frozen=True, slots=True)
class Score:
    threshold: float
    prompts: int
    diverged: int
    predicted: int  # flagged at the threshold (`flagged`)
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
            "threshold": round(self.threshold, 6) if math.isfinite(self.threshold) else None,
            "prompts": self.prompts,
            "diverged": self.diverged,
            "predicted": self.predicted,
            "caught": self.caught,
            "precision": round_or_none(self.precision),
            "recall": round_or_none(self.recall),
        }


# Each signal, and whether a value below ("below") or above the threshold flags a prompt.
SIGNALS = {
    "margin": "below",
    "deviation": "above",
    "attention_mass": "above",  # bench/signals/recovery.py
    "probe_kl": "above",
    "probe_shift": "above",
}


def flagged(row: dict[str, Any], signal: str, threshold: float) -> bool:
    """Whether `signal` at `threshold` predicts that the row's prompt diverges (SIGNALS says
    which side flags); a row without it (a prompt the gate did not check, a JSON from before
    the signal) is not flagged."""
    value = row.get(signal)
    if value is None:
        return False
    return bool(value < threshold if SIGNALS[signal] == "below" else value > threshold)


def score(rows: Sequence[dict[str, Any]], threshold: float, signal: str = "margin") -> Score:
    predicted = [flagged(row, signal, threshold) for row in rows]
    return Score(
        threshold,
        len(rows),
        sum(row["diverged"] for row in rows),
        sum(predicted),
        sum(p and row["diverged"] for p, row in zip(predicted, rows, strict=True)),
    )


def fit(rows: Sequence[dict[str, Any]], signal: str = "margin") -> Score:
    """The threshold on `signal` with the best F1 on `rows` (module docstring); one that flags
    nothing when no row diverged. Candidates sit just past each row's value, tried from the one
    that flags the fewest prompts on."""
    below = SIGNALS[signal] == "below"
    step = 1e-9 if below else -1e-9
    values = {row[signal] + step for row in rows if row.get(signal) is not None}
    best = score(rows, 0.0 if below else float("inf"), signal)
    for threshold in sorted(values, reverse=not below):
        candidate = score(rows, threshold, signal)
        if candidate.f1 > best.f1:
            best = candidate
    return best


def round_or_none(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def signals_report(
    fit_reports: dict[str, dict[str, Any]],
    test_reports: dict[str, dict[str, Any]],
    strategies: Sequence[str],
) -> dict[str, Any]:
    """Each signal's threshold fitted on `fit_reports`' prompts and scored on `test_reports`'
    (All-Gather bench JSONs by path), per strategy and over them all."""

    def rows(reports: dict[str, dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
        found = []
        for path, report in reports.items():
            for name in names:
                signals = report.get("strategies", {}).get(name, {}).get("signals")
                if signals is None:
                    raise ValueError(f"{path} has no signals for {name!r} (an older bench JSON?)")
                found += signals
        return found

    report: dict[str, Any] = {"fit_on": sorted(fit_reports), "test_on": sorted(test_reports)}
    for signal in SIGNALS:
        report[signal] = {}
        for label, names in [(name, [name]) for name in strategies] + [("all", list(strategies))]:
            fitted = fit(rows(fit_reports, names), signal)
            report[signal][label] = {
                "fit": fitted.as_dict(),
                "test": score(rows(test_reports, names), fitted.threshold, signal).as_dict(),
            }
    return report


def print_signals(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="margin < threshold, or another signal > it, predicts a diverging output")
    columns = ("signal", "strategy", "threshold", "fit P / R (prompts)", "test P / R (prompts)")
    for column in columns:
        table.add_column(column)
    for signal in SIGNALS:
        for label, row in report[signal].items():
            fitted, tested = row["fit"], row["test"]
            table.add_row(
                signal,
                label,
                "-" if fitted["threshold"] is None else f"{fitted['threshold']:.4f}",
                f"{fitted['precision']} / {fitted['recall']} ({fitted['prompts']})",
                f"{tested['precision']} / {tested['recall']} ({tested['prompts']})",
            )
    console.print(table)
