"""A strategy's run and its summary against full prefill: the JSON report both engines'
All-Gather benches write (bench/allgather/run.py, bench/allgather/vllm.py).

A run holds per round the computed tokens (token-layers / layers) and prefill seconds, the KV bytes
per agent, the quality gate's fallbacks and deviations, and per (round, agent) the first generated
position's logits and the greedy tokens; its summary measures quality against the reference run's.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from kmesh.bench.common import hardware
from kmesh.bench.quality import Quality, next_token_kl
from kmesh.bench.signals.divergence import round_or_none, top1_margin


@dataclass(slots=True)
class StrategyRun:
    name: str
    # Per round: computed tokens (token-layers / layers) and prefill seconds.
    computed: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    kv_bytes_per_agent: float = 0.0
    fallbacks: int = 0
    # Per (round, agent) whose region the gate checked: the mean relative key deviation at the
    # check layer (the gate's signal).
    deviations: dict[tuple[int, int], float] = field(default_factory=dict)
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # Per (round, agent) of rounds >= 1: bench/signals/recovery.py's signals of its prompt.
    probes: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    greedy: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, r: int, computed: float = 0.0, seconds: float = 0.0) -> None:
        while len(self.computed) <= r:
            self.computed.append(0.0)
            self.seconds.append(0.0)
        self.computed[r] += computed
        self.seconds[r] += seconds

    @property
    def computed_tokens(self) -> float:
        return sum(self.computed)

    @property
    def prefill_seconds(self) -> float:
        return sum(self.seconds)


def summary_of(run: StrategyRun, reference: StrategyRun) -> dict[str, Any]:
    keys = sorted(run.greedy)
    quality = Quality.measure(
        torch.stack([reference.logits[k] for k in keys]),
        torch.stack([run.logits[k] for k in keys]),
        [reference.greedy[k] for k in keys],
        [run.greedy[k] for k in keys],
    )
    return {
        "computed_tokens": round(run.computed_tokens, 2),
        "prefill_seconds": round(run.prefill_seconds, 3),
        # Rounds >= 1, where the prompts hold the outputs: the work reuse can save.
        "computed_tokens_reuse_rounds": round(sum(run.computed[1:]), 2),
        "prefill_seconds_reuse_rounds": round(sum(run.seconds[1:]), 3),
        "per_round": [
            {"computed_tokens": round(c, 2), "prefill_seconds": round(t, 3)}
            for c, t in zip(run.computed, run.seconds, strict=True)
        ],
        "kv_bytes_per_agent": round(run.kv_bytes_per_agent),
        "fallbacks": run.fallbacks,
        "check_deviation_max": (round(max(run.deviations.values()), 4) if run.deviations else None),
        "quality": quality.as_dict(),
        # Per prompt of rounds >= 1: what recovery saw and whether the output diverged.
        "signals": signal_rows(run, reference),
        **run.extra,
    }


def sweep_row(policy: str, ratio: float, strategy: str, summary: dict[str, Any]) -> dict[str, Any]:
    """One row of a `--sweep` (both engines): a strategy's compute and quality at one ratio."""
    kept = ("computed_tokens", "prefill_seconds", "quality")
    return {"policy": policy, "ratio": ratio, "strategy": strategy, **{k: summary[k] for k in kept}}


def signal_rows(run: StrategyRun, reference: StrategyRun) -> list[dict[str, Any]]:
    """Per prompt of rounds >= 1, what recovery saw and whether the output diverged (the rows
    bench/signals/divergence.py fits and scores)."""
    rows = []
    for key in sorted(run.greedy):
        got, want = run.logits[key], reference.logits[key]
        rows.append(
            {
                "round": key[0],
                "agent": key[1],
                "margin": round(top1_margin(got), 6),
                "reference_margin": round(top1_margin(want), 6),
                "deviation": round_or_none(run.deviations.get(key), 6),
                **{name: round(value, 6) for name, value in run.probes.get(key, {}).items()},
                "kl": round(float(next_token_kl(want[None], got[None])[0]), 6),
                "diverged": run.greedy[key] != reference.greedy[key],
            }
        )
    return rows


def strategies_report(runs: dict[str, dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """The report of the four strategies' summaries (the JSON both engines' benches write)."""
    per_request, collective = runs["per_request"], runs["collective"]
    dense = runs["full"]["kv_bytes_per_agent"]
    new = config["new_tokens_per_round"][-1]
    return {
        "hardware": hardware(),
        "note": (
            "CPU figures are functional/trend results, not comparable to the papers' GPU numbers"
        ),
        "config": config,
        "strategies": runs,
        "comparison": {
            "computed_collective_over_per_request": _ratio(
                collective["computed_tokens"], per_request["computed_tokens"]
            ),
            "seconds_collective_over_per_request": _ratio(
                collective["prefill_seconds"], per_request["prefill_seconds"]
            ),
            "computed_collective_over_prefix": _ratio(
                collective["computed_tokens"], runs["prefix"]["computed_tokens"]
            ),
            # The last round's computed tokens over the tokens new to the system in it.
            "last_round_computed_over_new": {
                name: _ratio(run["per_round"][-1]["computed_tokens"], new)
                for name, run in runs.items()
            },
            "computed_collective_over_per_request_reuse_rounds": _ratio(
                collective["computed_tokens_reuse_rounds"],
                per_request["computed_tokens_reuse_rounds"],
            ),
            "seconds_collective_over_per_request_reuse_rounds": _ratio(
                collective["prefill_seconds_reuse_rounds"],
                per_request["prefill_seconds_reuse_rounds"],
            ),
            "kv_dense_over_collective": _ratio(dense, collective["kv_bytes_per_agent"]),
            "kv_dense_over_mirror": _ratio(dense, collective["kv_bytes_mirror_per_agent"]),
        },
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def scaling_row(report: dict[str, Any]) -> dict[str, Any]:
    """Compute, time and storage of one agent count (from its report)."""
    keys = ("computed_tokens", "prefill_seconds", "kv_bytes_per_agent")
    return {
        "agents": report["config"]["agents"],
        "strategies": {
            name: {key: row[key] for key in keys} for name, row in report["strategies"].items()
        },
        "kv_dense_over_collective": report["comparison"]["kv_dense_over_collective"],
        "kv_dense_over_mirror": report["comparison"]["kv_dense_over_mirror"],
    }
