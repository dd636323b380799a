"""Scoring a strategy's probes against the truth and against full prefill's, item by item.

An engine answers each probe (workloads/tasks.py) with a `ProbeResult`: forced probes, per tail
index j >= 1 the next-token distribution that predicts tail[j] (None where the engine did not
compute the row before it); choice probes, the distribution after the tail; free probes, the
generated text. A distribution is known only partly, {token id: natural-log probability} for the
engine's top-k and the tokens the probe needs (the tail's token, every candidate).

Per item: its answer (forced: the top-1 tokens at its positions; choice: the most likely
candidate; free: the number extracted after its name), whether the answer is the truth, and full
prefill's margin at the answer (forced: the least top-1 gap over its positions; choice: the gap
between the two most likely candidates; free: none). A strategy is compared with full prefill on
the same items: accuracy, retention (accuracy over full's, paired bootstrap interval), McNemar on
the items where they differ, agreement of the answers (all, and by full's margin), and per scored
position the KL from full's distribution (coarse: bench/tasks/stats.py) and top-1 agreement.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.bench.tasks.stats import (
    agreement_by_margin,
    coarse_kl,
    margin,
    mcnemar,
    retention_interval,
)
from kmesh.workloads.tasks import Item, Probe, extract_record

Distribution = Mapping[int, float]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    # forced: per tail index (index 0 unused); choice: one, after the tail; free: none.
    positions: tuple[Distribution | None, ...] = ()
    text: str = ""


@dataclass(frozen=True, slots=True)
class Answer:
    key: str
    answer: Any
    correct: bool
    margin: float | None


def answers(probe: Probe, result: ProbeResult) -> list[Answer]:
    """Each of the probe's items answered from the engine's result."""
    if probe.kind == "free":
        found = extract_record(result.text)
        return [
            Answer(i.key, found.get(i.name), found.get(i.name) == i.truth, None)
            for i in probe.items
        ]
    out = []
    for item in probe.items:
        if probe.kind == "choice":
            dist = _known(result.positions[0], item)
            scores = {c: dist[c] for c in item.candidates}
            answer: Any = max(scores, key=scores.__getitem__)
            out.append(Answer(item.key, answer, (answer,) == item.truth, margin(scores)))
            continue
        dists = [_known(result.positions[j], item) for j in item.positions]
        answer = tuple(max(d, key=d.__getitem__) for d in dists)
        gap = min(margin(d) for d in dists)
        out.append(Answer(item.key, answer, answer == item.truth, gap))
    return out


def _known(dist: Distribution | None, item: Item) -> Distribution:
    if dist is None:
        raise ValueError(f"item {item.key}: the engine computed no distribution where it is scored")
    return dist


def scored_positions(probe: Probe, result: ProbeResult) -> list[tuple[int, Distribution]]:
    """(index, distribution) of every position a probe scores tokens at: a forced probe's
    computed tail rows, a choice probe's answer; none for free probes."""
    if probe.kind == "free":
        return []
    return [(j, d) for j, d in enumerate(result.positions) if d is not None]


def compare(
    probes: Sequence[Probe],
    full: Sequence[ProbeResult],
    other: Sequence[ProbeResult],
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """A strategy's figures on one task's probes against full prefill's (same probe order)."""
    ref = [a for p, r in zip(probes, full, strict=True) for a in answers(p, r)]
    got = [a for p, r in zip(probes, other, strict=True) for a in answers(p, r)]
    right = [a.correct for a in got]
    full_right = [a.correct for a in ref]
    agree = [a.answer == b.answer for a, b in zip(got, ref, strict=True)]
    accuracy = sum(right) / len(right)
    full_accuracy = sum(full_right) / len(full_right)
    interval = retention_interval(full_right, right, seed=seed)
    test = mcnemar(full_right, right)
    kls, top1 = [], []
    for probe, f, o in zip(probes, full, other, strict=True):
        theirs = dict(scored_positions(probe, o))
        for j, dist in scored_positions(probe, f):
            if j in theirs:
                kls.append(coarse_kl(dist, theirs[j]))
                top1.append(_top(dist) == _top(theirs[j]))
    return {
        "items": len(right),
        "accuracy": round(accuracy, 4),
        "retention": None if full_accuracy == 0 else round(accuracy / full_accuracy, 4),
        "retention_ci": None if interval is None else [round(x, 4) for x in interval],
        "mcnemar": {
            "only_full": test.only_full,
            "only_other": test.only_other,
            "p_value": round(test.p_value, 4),
        },
        "agreement": round(sum(agree) / len(agree), 4),
        "agreement_by_margin": agreement_by_margin(agree, [a.margin for a in ref]),
        "kl_mean": round(sum(kls) / len(kls), 5) if kls else None,
        "token_agreement": round(sum(top1) / len(top1), 4) if top1 else None,
    }


def accuracy(probes: Sequence[Probe], results: Sequence[ProbeResult]) -> float:
    got = [a.correct for p, r in zip(probes, results, strict=True) for a in answers(p, r)]
    return sum(got) / len(got)


def _top(dist: Distribution) -> int:
    return max(dist, key=dist.__getitem__)
