"""Closed-loop quality of the All-Gather strategies: errors compound as a user would see them.

In the replayed benchmark every strategy reads the same prompts (the trace's outputs). In closed
loop each round's outputs are generated (greedy, up to the workload's output tokens, ending at
the model's end of message) from the state of the strategy under test and feed the next round's
prompts (workloads/allgather.py::Council), so an approximate output changes what every agent
reads next. Each strategy is compared with full prefill's own closed loop, agent by agent and
round by round: the share of outputs identical to full prefill's, and the mean length of the
common prefix as a fraction of full prefill's output length.

Each loop also counts the prompt tokens its engine computed per round: prefill plus recovery's
own and the masters it built (`computed_of`), the frontier sweep's x axis
(bench/allgather/frontier.py).

The engine is behind one callable, `generate(label, round, turns) -> what each agent said`: the
vLLM bench sends the requests of the label's strategy and settings to vLLM with KMeshConnector,
the reference engine's driver sends the same declarations to kmesh.engine.Engine. A label names a
strategy (STRATEGIES) at one setting of the knobs; the plain run's labels are the strategies.
"""

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.bench.allgather.config import STRATEGIES, AllGatherBenchConfig
from kmesh.bench.allgather.strategy_requests import strategy_request
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.state.request_meta import parse_kmesh_params
from kmesh.workloads.allgather import AgentTurn, AllGatherConfig, Council


@dataclass(frozen=True, slots=True)
class Said:
    """One agent's answer in one round, and the prompt tokens its engine computed for it."""

    output_ids: list[int]
    computed_tokens: float


# (label, round, the round's turns with empty outputs) -> what each agent said.
Generate = Callable[[str, int, list[AgentTurn]], list[Said]]
# label -> (strategy, its settings): what a loop runs.
Loops = Mapping[str, tuple[str, AllGatherBenchConfig]]


def computed_of(computed_tokens: float, recovery: Mapping[str, Any] | None) -> float:
    """A request's computed prompt tokens: the engine's prefill plus, with a recovery report,
    recovery's own and the round master it built (token-layers / layers)."""
    recovery = recovery or {}
    return (
        computed_tokens
        + recovery.get("computed_tokens", 0.0)
        + recovery.get("shared_computed_tokens", 0.0)
    )


def plain_loops(cfg: AllGatherBenchConfig) -> dict[str, tuple[str, AllGatherBenchConfig]]:
    """The plain run's loops: every strategy at `cfg`, labelled by its name."""
    return {name: (name, cfg) for name in STRATEGIES}


def run_closed_loop(
    workload: AllGatherConfig,
    tokenizer: Any,
    labels: Sequence[str],
    generate: Generate,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list[list[Said]]]:
    """Each label's council, run on its own outputs: per label, per round, per agent."""
    outputs: dict[str, list[list[Said]]] = {}
    for label in labels:
        progress(f"closed loop: {label}")
        council = Council(workload, tokenizer)
        rounds = []
        for r in range(workload.rounds):
            prompts = council.prompts()
            turns = [AgentTurn(r, a, p, (), "") for a, p in enumerate(prompts)]
            said = generate(label, r, turns)
            council.answer(prompts, [s.output_ids for s in said])
            rounds.append(said)
        outputs[label] = rounds
    return outputs


def reference_closed_loop(
    engine: Engine,
    tokenizer: Any,
    workload: AllGatherConfig,
    loops: Loops,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, list[float]]]:
    """The closed loops through the reference engine (one label's salts apart from another's):
    the strategies' declarations as Request.recovery (the same objects vLLM's connector takes).
    `loops` must hold "full", the reference."""
    params = SamplingParams(max_tokens=workload.output_tokens)
    ids = itertools.count()

    def generate(label: str, r: int, turns: list[AgentTurn]) -> list[Said]:
        name, cfg = loops[label]
        requests = []
        for turn in turns:
            salt, kmesh = strategy_request(
                name, r, turn, cfg, workload.agents, f":closed-loop:{label}"
            )
            recovery = None
            declared = None if kmesh is None else parse_kmesh_params(kmesh)
            if declared is not None and declared.recovery is not None:
                recovery = RecoveryRequest(turn.prompt.spans, declared.recovery, declared.family)
            request_id = f"closed-{label}-{r}-{turn.agent}-{next(ids)}"
            keep = declared is not None and declared.keep_output
            requests.append(
                Request(
                    request_id,
                    turn.prompt.token_ids,
                    params,
                    salt,
                    recovery=recovery,
                    keep_output=keep,
                )
            )
        return [
            Said(list(out.output_ids), computed_of(out.stats.computed_tokens, out.stats.recovery))
            for out in engine.generate(requests)
        ]

    outputs = run_closed_loop(workload, tokenizer, list(loops), generate, progress)
    return closed_loop_summary(outputs)


def closed_loop_summary(
    outputs: dict[str, list[list[Said]]], reference: str = "full"
) -> dict[str, dict[str, list[float]]]:
    """Per label: `identical_share_per_round` and `common_prefix_mean_per_round` against the
    reference label's outputs, and `computed_tokens_per_round`."""
    ref = outputs[reference]
    summary = {}
    for name, rounds in outputs.items():
        identical, prefix, computed = [], [], []
        for got, want in zip(rounds, ref, strict=True):
            computed.append(round(sum(s.computed_tokens for s in got), 1))
            pairs = [(g.output_ids, w.output_ids) for g, w in zip(got, want, strict=True)]
            identical.append(round(sum(g == w for g, w in pairs) / len(pairs), 4))
            prefix.append(
                round(sum(_common(g, w) / max(len(w), 1) for g, w in pairs) / len(pairs), 4)
            )
        summary[name] = {
            "identical_share_per_round": identical,
            "common_prefix_mean_per_round": prefix,
            "computed_tokens_per_round": computed,
        }
    return summary


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
