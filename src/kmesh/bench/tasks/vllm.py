"""The task bench's engine: vLLM with KMeshConnector (one engine, strategies apart by salt).

A strategy's round is sent as the All-Gather bench sends it (bench/allgather/strategy_requests.py:
its salt and `kmesh` object; kmesh_exact: the segments under an exact salt, KMesh's exact reuse
only), all turns at once with max_tokens=1: computed tokens (vLLM's plus KMesh's executor's) and
seconds. Then each turn's probes, under the same salt and with no recovery (`page_tails` off):
vLLM hits the whole pages the turn left (their KV is the strategy's) and computes the rest
itself, the turn's partial last page and the probe's tail (that partial page, mostly the
instruction, is computed exactly where the strategy recovered it: up to a page of the last
reused message). Forced probes ask for prompt log-probabilities (vLLM's `prompt_logprobs`, read
only where vLLM computed the row before: positions above its cached tokens), choice probes for
the whole vocabulary's at the first generated token, free probes generate greedily.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any

from kmesh.bench.allgather.closed_loop import computed_of
from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.strategy_requests import VANILLA, strategy_request
from kmesh.bench.tasks.config import TasksBenchConfig
from kmesh.bench.tasks.run import run_tasks_bench
from kmesh.bench.tasks.score import ProbeResult
from kmesh.bench.vllm_logits import first_token_logits, first_token_params, generate
from kmesh.workloads.allgather import AgentTurn
from kmesh.workloads.tasks import Probe, TaskCouncil, TasksConfig, TaskTurn

# The most likely tokens kept per scored position (vLLM's max_logprobs default).
TOP_K = 20
# Free probes: tokens per member's record ("Ann proposed 47." is 6-7), and a margin.
FREE_TOKENS_PER_MEMBER = 8


def reduce(logprobs: Any, k: int, needed: Sequence[int]) -> dict[int, float]:
    """A [vocab] log-probability tensor as {token: logprob} for its top k and `needed`."""
    top = logprobs.topk(k)
    out = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
    out.update({int(t): float(logprobs[t]) for t in needed})
    return out


class VllmTaskEngine:
    def __init__(self, llm: Any, agents: int, vocab_size: int) -> None:
        self.llm = llm
        self.agents = agents
        self.vocab_size = vocab_size

    def request(
        self, name: str, r: int, turn: AgentTurn, cfg: AllGatherBenchConfig, variant: str
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The prompt (ids, salt) and kmesh object of one turn under strategy `name`."""
        if name == "kmesh_exact":
            salt: str | None = f"kmesh_exact{variant}"
            kmesh: dict[str, Any] | None = {
                "segments": [
                    {"token_ids": list(s.token_ids), "role": s.role.value}
                    for s in turn.prompt.segments
                ]
            }
        else:
            salt, kmesh = strategy_request(name, r, turn, cfg, self.agents, variant)
        prompt: dict[str, Any] = {"prompt_token_ids": list(turn.prompt.token_ids)}
        if salt is not None:
            prompt["cache_salt"] = salt
        return prompt, kmesh

    def prefill(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, r: int, turns: list[AgentTurn]
    ) -> dict[str, float]:
        """Round r's turns under the strategy, timed: computed tokens, seconds, fallbacks."""
        from vllm import SamplingParams

        requests = [self.request(name, r, t, cfg, variant) for t in turns]
        started = time.perf_counter()
        outs = generate(self.llm, requests, SamplingParams(temperature=0, max_tokens=1))
        seconds = time.perf_counter() - started
        computed = fallbacks = 0.0
        for out in outs:
            stats = out.kv_transfer_params["kmesh"]
            recovery = stats.get("recovery") or {}
            computed += computed_of(stats["computed_tokens"], recovery)
            fallbacks += int(recovery.get("fell_back", False))
        return {"computed_tokens": computed, "seconds": seconds, "fallbacks": fallbacks}

    def probe(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, turns: list[TaskTurn]
    ) -> list[list[ProbeResult]]:
        """Every probe of the turns (one round's, after `prefill`), per turn in probe order."""
        from vllm import SamplingParams

        sent: list[tuple[int, int, Probe, dict[str, Any]]] = []
        for t, task_turn in enumerate(turns):
            turn = task_turn.turn
            prompt, _ = self.request(name, turn.round, turn, cfg, variant)
            for p, probe in enumerate(task_turn.probes):
                ids = list(turn.prompt.token_ids) + list(probe.tail)
                sent.append((t, p, probe, {**prompt, "prompt_token_ids": ids}))
        forced = SamplingParams(
            max_tokens=1, prompt_logprobs=TOP_K, skip_reading_prefix_cache=False, detokenize=False
        )
        free = SamplingParams(temperature=0, max_tokens=FREE_TOKENS_PER_MEMBER * self.agents + 8)
        by_kind = {"forced": forced, "choice": first_token_params(), "free": free}
        results: dict[tuple[int, int], ProbeResult] = {}
        for kind, params in by_kind.items():
            batch = [s for s in sent if s[2].kind == kind]
            outs = generate(self.llm, [(s[3], dict(VANILLA)) for s in batch], params)
            for (t, p, probe, prompt), out in zip(batch, outs, strict=True):
                start = len(prompt["prompt_token_ids"]) - len(probe.tail)
                results[(t, p)] = self._result(kind, probe, start, out)
        return [[results[(t, p)] for p in range(len(tt.probes))] for t, tt in enumerate(turns)]

    def _result(self, kind: str, probe: Probe, start: int, out: Any) -> ProbeResult:
        if kind == "free":
            return ProbeResult(text=out.outputs[0].text)
        if kind == "choice":
            logprobs = first_token_logits(out, self.vocab_size)
            return ProbeResult((reduce(logprobs, TOP_K, probe.items[0].candidates),))
        # Rows up to the cached tokens were not computed by vLLM here: their entries are not
        # the model's; position p is predicted by row p - 1.
        valid_from = out.num_cached_tokens + 1
        positions: list[dict[int, float] | None] = [None]
        for j in range(1, len(probe.tail)):
            entry = out.prompt_logprobs[start + j] if start + j >= valid_from else None
            positions.append(
                None if entry is None else {int(t): float(lp.logprob) for t, lp in entry.items()}
            )
        return ProbeResult(tuple(positions))


def run_vllm_tasks(
    workload: TasksConfig,
    bench: TasksBenchConfig,
    base: AllGatherBenchConfig,
    model: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Start vLLM with KMeshConnector on the model (the embedded one when None), build the
    council on its tokenizer, run every strategy (bench/tasks/run.py)."""
    import json
    from pathlib import Path

    from vllm import LLM

    from kmesh.compute.config import ModelConfig
    from kmesh.compute.fingerprint import model_fingerprint
    from kmesh.compute.loader import load_tokenizer, resolve_model_dir
    from kmesh.vllm.config import DEFAULT_KV_CACHE_BYTES, vllm_engine_kwargs, workload_context

    path = resolve_model_dir(model)
    hf = json.loads((Path(path) / "config.json").read_text())
    description = ModelConfig.from_hf(hf)
    base = base.for_model(description)
    council = TaskCouncil(workload, load_tokenizer(path)).turns()
    longest = max(len(t.turn.prompt.token_ids) for t in council)
    widest = workload.agents * (longest + FREE_TOKENS_PER_MEMBER * workload.agents + 64)
    kv_bytes = description.kv_bytes_per_token("float32")
    progress("starting vLLM with KMeshConnector")
    llm = LLM(
        **vllm_engine_kwargs(
            path,
            max_model_len=workload_context(description, 2 * longest),
            kv_cache_bytes=max(DEFAULT_KV_CACHE_BYTES, 3 * widest * kv_bytes),
            max_logprobs=-1,
        )
    )
    try:
        engine = VllmTaskEngine(llm, workload.agents, hf["vocab_size"])
        # The executor's first use, untimed and under salts of its own.
        warm = [t.turn for t in council if t.turn.round == 1]
        for name in ("per_request", "collective"):
            engine.prefill(name, base, ":warm-up", 1, warm)
        return run_tasks_bench(
            engine, council, workload, bench, base, model_fingerprint(str(path)), progress
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
