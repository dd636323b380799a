"""The task bench's engine: KMesh's reference engine (kmesh.engine), the same requests.

A strategy's turns are the All-Gather bench's declarations (bench/allgather/strategy_requests.py)
as `Request.recovery`, as the closed loop sends them (bench/allgather/closed_loop.py); full and
prefix are the engine's own prefill and prefix cache, and kmesh_exact is the prefix cache under a
salt of its own (this engine's exact reuse is its prefix cache; vLLM's adds KMesh's page tails).
Probes go under the same salt without recovery: the engine hits the turn's cached blocks and
computes the rest, giving prompt log-probabilities (`SamplingParams.prompt_logprobs`) where it
computed the row before, the logits of the first generated token (`keep_logits`), or greedy text.
"""

import itertools
import time
from collections.abc import Callable
from typing import Any

from kmesh.bench.allgather.closed_loop import computed_of
from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.strategy_requests import strategy_request
from kmesh.bench.tasks.config import TasksBenchConfig
from kmesh.bench.tasks.run import run_tasks_bench
from kmesh.bench.tasks.score import ProbeResult
from kmesh.bench.tasks.vllm import FREE_TOKENS_PER_MEMBER, TOP_K, reduce
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.state.request_meta import parse_kmesh_params
from kmesh.workloads.allgather import AgentTurn
from kmesh.workloads.tasks import Probe, TaskCouncil, TasksConfig, TaskTurn


class ReferenceTaskEngine:
    def __init__(self, engine: Engine, agents: int, decode: Callable[[list[int]], str]) -> None:
        self.engine = engine
        self.agents = agents
        self.decode = decode
        self._ids = itertools.count()

    def _salt_and_recovery(
        self, name: str, r: int, turn: AgentTurn, cfg: AllGatherBenchConfig, variant: str
    ) -> tuple[str | None, RecoveryRequest | None, bool]:
        if name == "kmesh_exact":
            return f"kmesh_exact{variant}", None, False
        salt, kmesh = strategy_request(name, r, turn, cfg, self.agents, variant)
        declared = None if kmesh is None else parse_kmesh_params(kmesh)
        if declared is None or declared.recovery is None:
            return salt, None, False
        recovery = RecoveryRequest(turn.prompt.spans, declared.recovery, declared.family)
        return salt, recovery, declared.keep_output

    def prefill(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, r: int, turns: list[AgentTurn]
    ) -> dict[str, float]:
        requests = []
        for turn in turns:
            salt, recovery, keep = self._salt_and_recovery(name, r, turn, cfg, variant)
            requests.append(
                Request(
                    f"tasks-{next(self._ids)}",
                    turn.prompt.token_ids,
                    SamplingParams(max_tokens=1),
                    salt,
                    recovery=recovery,
                    keep_output=keep,
                )
            )
        started = time.perf_counter()
        outs = self.engine.generate(requests)
        seconds = time.perf_counter() - started
        computed = sum(computed_of(o.stats.computed_tokens, o.stats.recovery) for o in outs)
        fallbacks = sum(int((o.stats.recovery or {}).get("fell_back", False)) for o in outs)
        return {"computed_tokens": computed, "seconds": seconds, "fallbacks": float(fallbacks)}

    def probe(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, turns: list[TaskTurn]
    ) -> list[list[ProbeResult]]:
        params = {
            "forced": SamplingParams(max_tokens=1, prompt_logprobs=TOP_K),
            "choice": SamplingParams(max_tokens=1),
            "free": SamplingParams(max_tokens=FREE_TOKENS_PER_MEMBER * self.agents + 8),
        }
        sent: list[tuple[Probe, int, Request]] = []
        for task_turn in turns:
            turn = task_turn.turn
            salt, _, _ = self._salt_and_recovery(name, turn.round, turn, cfg, variant)
            for probe in task_turn.probes:
                ids = turn.prompt.token_ids + probe.tail
                request = Request(
                    f"tasks-{next(self._ids)}",
                    ids,
                    params[probe.kind],
                    salt,
                    keep_logits=probe.kind == "choice",
                )
                sent.append((probe, len(turn.prompt.token_ids), request))
        outs = self.engine.generate([request for _, _, request in sent])
        flat = [
            self._result(probe, start, out)
            for (probe, start, _), out in zip(sent, outs, strict=True)
        ]
        results, at = [], 0
        for task_turn in turns:
            results.append(flat[at : at + len(task_turn.probes)])
            at += len(task_turn.probes)
        return results

    def _result(self, probe: Probe, start: int, out: Any) -> ProbeResult:
        if probe.kind == "free":
            return ProbeResult(text=self.decode(list(out.output_ids)))
        if probe.kind == "choice":
            logprobs = out.logits[0].log_softmax(-1)
            return ProbeResult((reduce(logprobs, TOP_K, probe.items[0].candidates),))
        entries = out.prompt_logprobs
        return ProbeResult((None, *(entries[start + j] for j in range(1, len(probe.tail)))))


def run_reference_tasks(
    workload: TasksConfig,
    bench: TasksBenchConfig,
    base: AllGatherBenchConfig,
    model: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The reference engine on the model (the embedded one when None), every strategy."""
    from kmesh.compute.loader import load_model

    loaded = load_model(model)
    base = base.for_model(loaded.config)
    council = TaskCouncil(workload, loaded.tokenizer).turns()
    longest = max(len(t.turn.prompt.token_ids) for t in council)
    room = 3 * workload.agents * (longest + FREE_TOKENS_PER_MEMBER * workload.agents + 64)
    engine = Engine(
        loaded.executor,
        loaded.fingerprint,
        kv_cache_tokens=max(16384, room),
        decode=loaded.tokenizer.decode,
    )

    def decode(ids: list[int]) -> str:
        return str(loaded.tokenizer.decode(ids, skip_special_tokens=True))

    tasks_engine = ReferenceTaskEngine(engine, workload.agents, decode)
    return run_tasks_bench(
        tasks_engine, council, workload, bench, base, loaded.fingerprint, progress
    )
