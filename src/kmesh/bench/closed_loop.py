"""Closed-loop quality of the All-Gather strategies: errors compound as a user would see them.

In the replayed benchmark every strategy reads the same prompts (the trace's outputs). In closed
loop each round's outputs are generated (greedy, up to the workload's output tokens, ending at
the model's end of message) from the state of the strategy under test and feed the next round's
prompts (workloads/allgather.py::Council), so an approximate output changes what every agent
reads next. Each strategy is compared with full prefill's own closed loop, agent by agent and
round by round: the share of outputs identical to full prefill's, and the mean length of the
common prefix as a fraction of full prefill's output length.

The engine is behind one callable, `generate(strategy, round, turns) -> outputs`: the vLLM bench
sends the strategy's requests to vLLM with KMeshConnector, the reference engine's driver sends the
same declarations to kmesh.engine.Engine.
"""

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from kmesh.bench.allgather_config import STRATEGIES, AllGatherBenchConfig
from kmesh.bench.strategy_requests import strategy_request
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.state.request_meta import parse_kmesh_params
from kmesh.workloads.allgather import AgentTurn, AllGatherConfig, Council

# (strategy, round, the round's turns with empty outputs) -> each agent's generated token ids.
Generate = Callable[[str, int, list[AgentTurn]], list[list[int]]]


def run_closed_loop(
    workload: AllGatherConfig,
    tokenizer: Any,
    strategies: Sequence[str],
    generate: Generate,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list[list[list[int]]]]:
    """Each strategy's council, run on its own outputs: per strategy, per round, per agent."""
    outputs: dict[str, list[list[list[int]]]] = {}
    for name in strategies:
        progress(f"closed loop: {name}")
        council = Council(workload, tokenizer)
        rounds = []
        for r in range(workload.rounds):
            prompts = council.prompts()
            turns = [AgentTurn(r, a, p, (), "") for a, p in enumerate(prompts)]
            said = generate(name, r, turns)
            council.answer(prompts, said)
            rounds.append(said)
        outputs[name] = rounds
    return outputs


def reference_closed_loop(
    engine: Engine,
    tokenizer: Any,
    workload: AllGatherConfig,
    cfg: AllGatherBenchConfig,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, list[float]]]:
    """The closed loop through the reference engine: the strategies' declarations as
    Request.recovery (the same objects vLLM's connector takes)."""
    params = SamplingParams(max_tokens=workload.output_tokens)
    ids = itertools.count()

    def generate(name: str, r: int, turns: list[AgentTurn]) -> list[list[int]]:
        requests = []
        for turn in turns:
            salt, kmesh = strategy_request(name, r, turn, cfg, workload.agents, ":closed-loop")
            recovery = None
            declared = None if kmesh is None else parse_kmesh_params(kmesh)
            if declared is not None and declared.recovery is not None:
                recovery = RecoveryRequest(turn.prompt.spans, declared.recovery, declared.family)
            request_id = f"closed-{name}-{r}-{turn.agent}-{next(ids)}"
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
        return [list(out.output_ids) for out in engine.generate(requests)]

    outputs = run_closed_loop(workload, tokenizer, STRATEGIES, generate, progress)
    return closed_loop_summary(outputs)


def closed_loop_summary(
    outputs: dict[str, list[list[list[int]]]], reference: str = "full"
) -> dict[str, dict[str, list[float]]]:
    """Per strategy: `identical_share_per_round` and `common_prefix_mean_per_round` against the
    reference strategy's outputs."""
    ref = outputs[reference]
    summary = {}
    for name, rounds in outputs.items():
        identical, prefix = [], []
        for got, want in zip(rounds, ref, strict=True):
            pairs = list(zip(got, want, strict=True))
            identical.append(round(sum(g == w for g, w in pairs) / len(pairs), 4))
            prefix.append(
                round(sum(_common(g, w) / max(len(w), 1) for g, w in pairs) / len(pairs), 4)
            )
        summary[name] = {
            "identical_share_per_round": identical,
            "common_prefix_mean_per_round": prefix,
        }
    return summary


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
