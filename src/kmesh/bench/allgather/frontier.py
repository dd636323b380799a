"""The frontier sweep of the All-Gather bench (`--frontier`, both engines): each approximate
strategy at each point of its budget knobs, measured open loop on the replayed trace and closed
loop (bench/allgather/closed_loop.py), and each strategy's Pareto frontier of compute against
the share of outputs identical to full prefill's.

A point is a strategy (per_request or collective) with some knobs set over the bench's
configuration (POINTS; a label such as `collective@agent_ratio=0.3` names it). Per point the
report holds the open loop's computed tokens and quality (KL, top-1, greedy@32, as the strategies'
rows) and the closed loop's computed tokens and identical share per round. The frontier's axes:
x, the closed loop's computed prompt tokens (what the compute bought); y, its identical share
averaged over the rounds that hold outputs (rounds >= 1; round 0 is exact under every strategy).

Invariants: a strategy's frontier holds its points that no other point of it dominates (no more
tokens and no lower share, one of them strictly), in order of tokens, so its shares rise; a point
where collective is below per_request names a per_request frontier point whose share beats the
best collective share reached with at most its tokens.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kmesh.bench.allgather.closed_loop import Loops
from kmesh.bench.allgather.config import AllGatherBenchConfig


@dataclass(frozen=True, slots=True)
class Point:
    strategy: str
    knobs: tuple[tuple[str, Any], ...]  # (AllGatherBenchConfig field, value)

    @property
    def label(self) -> str:
        return f"{self.strategy}@" + ",".join(f"{k}={v}" for k, v in self.knobs)

    def config(self, base: AllGatherBenchConfig) -> AllGatherBenchConfig:
        return replace(base, **dict(self.knobs))


def _points(strategy: str, knob: str, values: Sequence[Any], **fixed: Any) -> list[Point]:
    return [Point(strategy, ((knob, v), *fixed.items())) for v in values]


# The sweep's grid. The knobs: per_request's recompute ratio; collective's agent ratio (sibling
# master, the default, and the common one); and the gate's threshold, the runtime's own signal
# (normal reuse deviates 0.006-0.022 at layer 1 on the embedded model, so thresholds in that range
# send the most deviant regions to the engine's exact prefill). A first sweep (agent ratios 0.5 and
# 0.7, per_request 0.5, the common master at 0.3; docs/benchmarks.md, quality frontier) found no
# point of those on a frontier; the gate's thresholds took their place.
POINTS: tuple[Point, ...] = (
    *_points("per_request", "recompute_ratio", (0.15, 0.3, 0.7, 0.9)),
    *_points("per_request", "gate", (0.01,), recompute_ratio=0.3),
    *_points("collective", "agent_ratio", (0.0, 0.3), master="sibling"),
    *_points("collective", "agent_ratio", (0.0,), master="common"),
    *_points(
        "collective", "gate", (0.015, 0.0125, 0.011, 0.01, 0.009), agent_ratio=0.0, master="sibling"
    ),
)
# The exact strategies every frontier report carries as anchors (full is the closed loop's
# reference; prefix is vanilla prefix caching).
ANCHORS = ("full", "prefix")


def frontier_loops(base: AllGatherBenchConfig, points: Sequence[Point] = POINTS) -> Loops:
    """The closed loops a frontier runs: the anchors at `base`, then every point."""
    loops = {name: (name, base) for name in ANCHORS}
    loops.update({p.label: (p.strategy, p.config(base)) for p in points})
    return loops


def run_frontier(
    base: AllGatherBenchConfig,
    open_loop: Callable[[str, str, AllGatherBenchConfig], dict[str, Any]],
    closed_loops: Callable[[Loops], dict[str, dict[str, list[float]]]],
    progress: Callable[[str], None] = lambda _: None,
    points: Sequence[Point] = POINTS,
) -> dict[str, Any]:
    """Measure every point: `open_loop(label, strategy, cfg)` gives its strategy row (computed
    tokens, quality) on the replayed trace; `closed_loops(loops)` gives each loop's summary."""
    rows = []
    for point in points:
        progress(f"frontier, open loop: {point.label}")
        row = open_loop(point.label, point.strategy, point.config(base))
        rows.append(
            {
                "label": point.label,
                "strategy": point.strategy,
                "knobs": dict(point.knobs),
                "computed_tokens": row["computed_tokens"],
                "quality": row["quality"],
            }
        )
    loops = closed_loops(frontier_loops(base, points))
    for row in rows:
        row["closed_loop"] = loops[row["label"]]
    anchors = {name: loops[name] for name in ANCHORS}
    return frontier_report(rows, anchors)


def frontier_report(
    rows: list[dict[str, Any]], anchors: Mapping[str, dict[str, list[float]]]
) -> dict[str, Any]:
    """The report's `frontier`: the points (each with its closed loop's x and y), the anchors'
    closed loops, each strategy's frontier (labels) and where collective is below per_request."""
    for row in rows:
        row["closed_loop_tokens"], row["closed_loop_identical"] = axes(row["closed_loop"])
    frontiers = {
        strategy: pareto([r for r in rows if r["strategy"] == strategy])
        for strategy in sorted({r["strategy"] for r in rows})
    }
    by_label = {r["label"]: r for r in rows}
    below = []
    if {"per_request", "collective"} <= frontiers.keys():
        below = collective_below(
            [by_label[x] for x in frontiers["per_request"]],
            [by_label[x] for x in frontiers["collective"]],
        )
    return {
        "points": rows,
        "anchors": {
            name: {**loop, **dict(zip(("tokens", "identical"), axes(loop), strict=True))}
            for name, loop in anchors.items()
        },
        "frontiers": frontiers,
        "collective_below_per_request": below,
    }


def axes(loop: Mapping[str, list[float]]) -> tuple[float, float]:
    """A closed loop's place on the plot: its computed tokens, and its identical share averaged
    over rounds >= 1 (all of them when there is one round)."""
    held = _with_outputs(loop["identical_share_per_round"])
    return round(sum(loop["computed_tokens_per_round"]), 1), round(sum(held) / len(held), 4)


def _with_outputs(shares: list[float]) -> list[float]:
    """The rounds that hold outputs (>= 1), or the only round."""
    return shares[1:] or shares


def pareto(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The labels of the rows no other row dominates, by tokens (fewer first)."""
    ordered = sorted(rows, key=lambda r: (r["closed_loop_tokens"], -r["closed_loop_identical"]))
    front, best = [], -1.0
    for row in ordered:
        if row["closed_loop_identical"] > best:
            front.append(row["label"])
            best = row["closed_loop_identical"]
    return front


def collective_below(
    per_request: Sequence[dict[str, Any]], collective: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per_request's frontier points above everything collective reaches with at most their
    tokens (none: collective's frontier is at or above per_request's at every budget)."""
    below = []
    for row in per_request:
        tokens = row["closed_loop_tokens"]
        reached = [
            c["closed_loop_identical"] for c in collective if c["closed_loop_tokens"] <= tokens
        ]
        best = max(reached, default=None)
        if best is None or best < row["closed_loop_identical"]:
            below.append(
                {
                    "per_request": row["label"],
                    "tokens": tokens,
                    "per_request_identical": row["closed_loop_identical"],
                    "collective_best_identical": best,
                }
            )
    return below


def calibration_rows(frontiers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The points measured in every one of `frontiers` (reports' `frontier`, each on its own
    trace), each with its worst figures over them: the largest next-token KL p95 and closed-loop
    tokens over vanilla prefix caching's, the least closed-loop identical share of any round
    >= 1. What kmesh/recovery/quality.py's calibrations record: a setting meets a target only
    if it met it on every trace."""
    by_label = [{p["label"]: p for p in f["points"]} for f in frontiers]
    rows = []
    for label, first in by_label[0].items():
        found = [points.get(label) for points in by_label]
        if any(p is None for p in found):
            continue
        points = [p for p in found if p is not None]
        prefix = [f["anchors"]["prefix"]["tokens"] for f in frontiers]
        shares = [p["closed_loop"]["identical_share_per_round"] for p in points]
        rows.append(
            {
                "label": label,
                "strategy": first["strategy"],
                "knobs": first["knobs"],
                "kl_p95": max(p["quality"]["kl_p95"] for p in points),
                "identical_min": min(min(_with_outputs(s)) for s in shares),
                "tokens_over_prefix": round(
                    max(p["closed_loop_tokens"] / t for p, t in zip(points, prefix, strict=True)),
                    4,
                ),
            }
        )
    return rows
