"""`kmesh bench tasks`: what each reuse strategy keeps of the agents' reading of their siblings'
messages, scored against ground truth (workloads/tasks.py) and against full prefill.

Every strategy runs the same council, round by round, in one engine: each round's turns timed
together (computed tokens, seconds), then, from round 1 on, each turn's probes on the messages it
just read (bench/tasks/vllm.py). Strategies:
- exact: full (full prefill, the reference), prefix (vanilla prefix caching), kmesh_exact
  (KMesh's exact reuse); one run each, the same at every budget (`budget_applies` false);
- per_request, collective: the default selection at each budget (the recompute share of the
  reused rows: per_request's ratio, collective's agent ratio; collective's master computed in
  full once per round after the common context), the quality gate on;
- collective+SELECTION: each other selection at each budget. At budget 0 no selection chooses
  anything, so collective's run there is every selection's.
Per task (bench/tasks/score.py): full prefill's accuracy and whether it passes the gate
(`accuracy_gate`, 0.7: a task full prefill cannot do says nothing about what reuse keeps), and
per strategy and budget its accuracy, retention and interval, McNemar, answer agreement (all and
by full prefill's margin), KL and token agreement, computed tokens and seconds.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.common import hardware
from kmesh.bench.tasks.config import TasksBenchConfig
from kmesh.bench.tasks.score import ProbeResult, accuracy, compare
from kmesh.workloads.allgather import AgentTurn
from kmesh.workloads.tasks import Probe, TasksConfig, TaskTurn

EXACT = ("full", "prefix", "kmesh_exact")


class TaskEngine(Protocol):
    def prefill(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, r: int, turns: list[AgentTurn]
    ) -> dict[str, float]: ...

    def probe(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, turns: list[TaskTurn]
    ) -> list[list[ProbeResult]]: ...


@dataclass(frozen=True, slots=True)
class Run:
    label: str  # a strategy: full, per_request, collective+query, ...
    name: str  # what the engine runs: full, prefix, kmesh_exact, per_request, collective
    cfg: AllGatherBenchConfig
    budget: float | None  # None: exact


def plan(bench: TasksBenchConfig, base: AllGatherBenchConfig) -> list[tuple[Run, list[str]]]:
    """The runs, each with the labels it reports under (a budget-0 collective run: every
    selection's)."""
    runs: list[tuple[Run, list[str]]] = [((Run(n, n, base, None)), [n]) for n in EXACT]
    default = bench.default_selection
    others = [s for s in bench.selections if s != default]
    for b in bench.budgets:
        if bench.per_request:
            cfg = replace(base, policy=default, recompute_ratio=b)
            runs.append((Run("per_request", "per_request", cfg, b), ["per_request"]))
        labels = [f"collective+{s}" for s in others]
        for selection in [default, *others] if b > 0 else [default]:
            label = "collective" if selection == default else f"collective+{selection}"
            cfg = replace(base, policy=selection, agent_ratio=b)
            runs.append(
                (Run(label, "collective", cfg, b), [label] if b > 0 else ["collective", *labels])
            )
    return runs


def run_tasks_bench(
    engine: TaskEngine,
    council: list[TaskTurn],
    workload: TasksConfig,
    bench: TasksBenchConfig,
    base: AllGatherBenchConfig,
    model: str,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    rounds: list[list[TaskTurn]] = [[] for _ in range(workload.rounds)]
    for task_turn in council:
        rounds[task_turn.turn.round].append(task_turn)
    probes = [p for r in rounds[1:] for t in r for p in t.probes]
    results: dict[str, dict[float | None, list[ProbeResult]]] = {}
    costs: dict[str, dict[float | None, dict[str, float]]] = {}
    for run, labels in plan(bench, base):
        progress(f"{run.label}" + ("" if run.budget is None else f" at budget {run.budget}"))
        variant = f":{run.label}:{run.budget}"
        cost = {"computed_tokens": 0.0, "seconds": 0.0, "fallbacks": 0.0}
        answered: list[ProbeResult] = []
        for r, turns in enumerate(rounds):
            for key, value in engine.prefill(
                run.name, run.cfg, variant, r, [t.turn for t in turns]
            ).items():
                cost[key] += value
            if r > 0:
                answered += [
                    x
                    for per_turn in engine.probe(run.name, run.cfg, variant, turns)
                    for x in per_turn
                ]
        for label in labels:
            results.setdefault(label, {})[run.budget] = answered
            costs.setdefault(label, {})[run.budget] = cost
    return {
        "model": model,
        "default_selection": bench.default_selection,
        "config": {
            **asdict(workload),
            **asdict(bench),
            **base.recovery_fields(),
            "hardware": hardware(),
        },
        "tasks": {
            task: _task_report(task, probes, results, costs, bench, workload.seed)
            for task in bench.tasks
        },
    }


def _task_report(
    task: str,
    probes: list[Probe],
    results: dict[str, dict[float | None, list[ProbeResult]]],
    costs: dict[str, dict[float | None, dict[str, float]]],
    bench: TasksBenchConfig,
    seed: int,
) -> dict[str, Any]:
    mine = [i for i, p in enumerate(probes) if p.task == task]
    ours = [probes[i] for i in mine]
    full = [results["full"][None][i] for i in mine]
    full_accuracy = accuracy(ours, full)
    strategies: dict[str, Any] = {}
    for label, by_budget in results.items():
        entry: dict[str, Any] = {"budget_applies": None not in by_budget, "by_budget": {}}
        for b in bench.budgets:
            run_budget = None if None in by_budget else b
            got = [by_budget[run_budget][i] for i in mine]
            figures = compare(ours, full, got, seed=seed)
            cost = costs[label][run_budget]
            figures |= {k: round(v, 3) for k, v in cost.items()}
            entry["by_budget"][str(b)] = figures
        strategies[label] = entry
    return {
        "full_accuracy": round(full_accuracy, 4),
        "gated": full_accuracy >= bench.accuracy_gate,
        "items": strategies["full"]["by_budget"][str(bench.budgets[0])]["items"],
        "strategies": strategies,
    }
