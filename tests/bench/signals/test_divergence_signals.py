"""The margin signal: its rows from a run, a threshold fitted on some prompts and scored on
others, and `kmesh bench signals` over bench JSONs."""

import json

import pytest
import torch

from kmesh.bench.allgather.summary import StrategyRun, signal_rows
from kmesh.bench.signals.divergence import fit, score, top1_margin
from tests.conftest import run_kmesh


def _row(margin: float, diverged: bool, deviation: float | None = None) -> dict:
    return {"margin": margin, "deviation": deviation, "diverged": diverged}


def test_the_margin_is_the_gap_between_the_two_most_likely_tokens():
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    assert top1_margin(logits) == pytest.approx(0.3)


def test_rows_say_which_prompts_diverged_and_what_recovery_saw():
    reference, run = StrategyRun("full"), StrategyRun("collective")
    run.deviations[(1, 1)] = 0.05
    for key, (ref, got) in {(1, 0): ([3, 4], [3, 4]), (1, 1): ([3, 4], [3, 5])}.items():
        reference.logits[key] = torch.tensor([0.0, 2.0, 1.0])
        run.logits[key] = torch.tensor([0.0, 1.0, 1.0]) if key == (1, 1) else torch.zeros(3)
        reference.greedy[key], run.greedy[key] = ref, got
    rows = signal_rows(run, reference)
    assert [(r["round"], r["agent"], r["diverged"]) for r in rows] == [(1, 0, False), (1, 1, True)]
    assert rows[1]["margin"] == 0.0 and rows[1]["reference_margin"] > 0.2 and rows[1]["kl"] > 0
    assert rows[0]["deviation"] is None and rows[1]["deviation"] == 0.05
    run.probes[(1, 1)] = {"attention_mass": 0.25, "probe_kl": 0.125, "probe_shift": 0.5}
    assert signal_rows(run, reference)[1]["probe_kl"] == 0.125


def test_the_fit_separates_low_margins_and_the_score_counts_precision_and_recall():
    rows = [_row(0.05, True), _row(0.1, True), _row(0.2, False), _row(0.5, False), _row(0.9, False)]
    fitted = fit(rows)
    assert 0.1 < fitted.threshold <= 0.2 and fitted.precision == 1.0 and fitted.recall == 1.0
    held_out = [_row(0.02, True), _row(0.08, False), _row(0.3, True), _row(0.8, False)]
    scored = score(held_out, fitted.threshold)
    assert (scored.predicted, scored.caught, scored.diverged) == (2, 1, 2)
    assert scored.precision == 0.5 and scored.recall == 0.5


def test_a_deviation_above_the_threshold_predicts_divergence_and_an_unchecked_prompt_is_not():
    rows = [_row(0.5, True, 0.2), _row(0.5, True, None), _row(0.5, False, 0.01)]
    fitted = fit(rows, "deviation")
    assert 0.01 <= fitted.threshold < 0.2 and (fitted.predicted, fitted.caught) == (1, 1)
    assert fitted.recall == 0.5


def test_the_recovery_signals_flag_above_the_threshold_and_rows_without_them_are_not_flagged():
    rows = [
        {"attention_mass": 0.4, "probe_kl": 0.02, "diverged": True},
        {"attention_mass": 0.1, "probe_kl": 0.001, "diverged": False},
        {"margin": 0.2, "deviation": None, "diverged": True},  # a JSON from before them
    ]
    for signal in ("attention_mass", "probe_kl"):
        fitted = fit(rows, signal)
        assert (fitted.predicted, fitted.caught, fitted.diverged) == (1, 1, 2)
        assert rows[1][signal] <= fitted.threshold < rows[0][signal]


def test_with_nothing_diverged_the_fit_predicts_nothing():
    fitted = fit([_row(0.1, False, 0.3), _row(0.7, False, 0.5)])
    assert fitted.threshold == 0.0 and fitted.predicted == 0 and fitted.recall is None
    by_deviation = fit([_row(0.1, False, 0.3)], "deviation")
    assert by_deviation.predicted == 0 and by_deviation.as_dict()["threshold"] is None


def test_the_cli_fits_on_one_set_of_files_and_scores_on_another(tmp_path):
    def bench_json(name, rows):
        strategies = {s: {"signals": rows} for s in ("per_request", "collective")}
        path = tmp_path / name
        path.write_text(json.dumps({"strategies": strategies}))
        return str(path)

    fit_on = bench_json("a.json", [_row(0.05, True), _row(0.6, False)])
    test_on = bench_json("b.json", [_row(0.01, True), _row(0.3, True), _row(0.9, False)])
    out = tmp_path / "signals.json"
    result = run_kmesh(
        "bench", "signals", "--fit", fit_on, "--test", test_on, "--json", str(out), timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["fit_on"] == [fit_on] and report["test_on"] == [test_on]
    tested = report["margin"]["all"]["test"]
    assert report["deviation"]["all"]["test"]["predicted"] == 0  # no deviation in these rows
    assert tested["prompts"] == 6 and tested["caught"] == 2 and tested["recall"] == 0.5
    again = run_kmesh("bench", "signals", "--fit", fit_on, "--test", fit_on, "--json", str(out))
    assert again.returncode == 2 and "different files" in again.stderr
    (tmp_path / "list.json").write_text("[]")
    wrong = run_kmesh(
        "bench",
        "signals",
        "--fit",
        fit_on,
        "--test",
        str(tmp_path / "list.json"),
        "--json",
        str(out),
    )
    assert wrong.returncode == 2 and "not a `kmesh bench allgather` report" in wrong.stderr
    assert "Traceback" not in again.stderr + wrong.stderr
