"""`kmesh bench allgather --engine vllm`: the All-Gather trace through vLLM with KMeshConnector.

The same trace and the same JSON as the reference-engine bench (bench/allgather/run.py), four ways,
in one vLLM engine (prefix caching on) whose requests are kept apart by cache_salt:
- full: vanilla vLLM's own full prefill, every prompt under a salt of its own (no prefix hit);
  the reference for quality.
- prefix: vanilla vLLM, prefix caching (no kmesh recovery): each agent's earlier prompts give
  its transcript's full blocks; exact.
- per_request: KMeshConnector recovers each prompt's rows after vLLM's local hit
  (kmesh/recovery/requests.py): stored segment KV re-rotated, `recompute_ratio` recomputed by the
  policy. Every turn keeps its output (`keep_output`): after a round is timed and measured, its
  prompts are run again untimed to generate their outputs (decode, not prefill: the outputs' KV
  is a by-product of generation, as in the reference bench), the connector keeps each generated
  output's KV, and the next round's readers reuse it (author KV) wherever the generated output is
  the trace's (`kept_outputs_matching_trace`); an output generated otherwise is computed in full by
  its first reader, whose KV later readers reuse (first-reader KV).
- collective: the rounds are declared (family + round id + the round's output segments): each
  round's outputs are recovered once, after the family's common context (`shared_ratio`, 1.0:
  computed in full), kept as the master, and placed in each agent's prompt; `agent_ratio`
  recomputed per agent.
Round 0 holds no outputs: every strategy sends it without recovery.

Accounting: computed_tokens = the tokens vLLM computed plus KMesh's executor's token-layers /
layers (the per-request recovery and the round's master); prefill_seconds = wall time of each
round's requests submitted together with max_tokens=1 (vLLM's prefill, with recovery inside).
Quality (rounds >= 1): the first generated position's full distribution (logprobs over the whole
vocabulary) and 32 greedy tokens, each from a second and third request with the same prompt, salt
and kmesh object (they hit the blocks the timed request left, and vLLM computes the partial last
block again against them, as the timed request did). kv_bytes_per_agent: vLLM keeps every agent's
pages dense (no block is shared across positions: keys carry RoPE), so all strategies hold the
round outputs' pages; collective adds its masters (kept by the worker) divided by the agents.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kmesh.bench.allgather.closed_loop import (
    Loops,
    Said,
    closed_loop_summary,
    computed_of,
    plain_loops,
    run_closed_loop,
)
from kmesh.bench.allgather.config import STRATEGIES, SWEEP_RATIOS, AllGatherBenchConfig
from kmesh.bench.allgather.frontier import run_frontier
from kmesh.bench.allgather.strategy_requests import strategy_request
from kmesh.bench.allgather.summary import StrategyRun, strategies_report, summary_of, sweep_row
from kmesh.bench.vllm_logits import first_token_logits, first_token_params, generate
from kmesh.recovery.collective import MASTER_CHOICES
from kmesh.workloads.allgather import (
    AgentTurn,
    AllGatherConfig,
    group_rounds,
    new_tokens,
    output_segment_id,
)


class VllmAllGatherBench:
    def __init__(
        self,
        llm: Any,
        turns: Sequence[AgentTurn],
        workload: AllGatherConfig,
        cfg: AllGatherBenchConfig,
        vocab_size: int,
        kv_bytes_per_token: int,
        block_size: int,
        progress: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.llm = llm
        self.block_size = block_size
        self.variant = ""  # told apart in the salts of a sweep's runs
        self.workload = workload
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.progress = progress
        self.rounds = group_rounds(turns)

    def report(
        self,
        fingerprint: str,
        sweep: bool = False,
        tokenizer: Any = None,
        closed_loop: bool = False,
        frontier: bool = False,
    ) -> dict[str, Any]:
        """The four strategies; with `sweep`, collective's agent ratios and master choices; with
        `closed_loop`, each strategy's closed loop; with `frontier`, the frontier sweep
        (bench/allgather/frontier.py). Closed loops need the tokenizer."""
        self._warm_up()
        runs = {name: self.run(name) for name in STRATEGIES}
        summaries = {name: summary_of(run, runs["full"]) for name, run in runs.items()}
        rows = self.sweep(runs["full"]) if sweep else None
        if closed_loop:
            for name, loop in self.closed_loops(tokenizer, plain_loops(self.cfg)).items():
                summaries[name]["closed_loop"] = loop
        found = None
        if frontier:
            found = run_frontier(
                self.cfg,
                lambda label, name, cfg: self.measure(name, cfg, f":{label}", runs["full"]),
                lambda loops: self.closed_loops(tokenizer, loops),
                self.progress,
            )
        cfg = self.cfg
        config = {
            "engine": "vllm",
            "agents": max(len(r) for r in self.rounds),
            "rounds": len(self.rounds),
            **cfg.recovery_fields(),
            "block_size": self.block_size,  # vLLM's pages; masters use kmesh/recovery/requests.py's
            "greedy_tokens": cfg.greedy_tokens,
            "model": fingerprint,
            "prompt_tokens": sum(len(t.prompt.token_ids) for r in self.rounds for t in r),
            "new_tokens_per_round": new_tokens(self.rounds),
            "order": self.workload.order,
            "seed": self.workload.seed,
            "output_tokens": self.workload.output_tokens,
        }
        report = strategies_report(summaries, config)
        if rows is not None:
            report["sweep"] = rows
        if found is not None:
            report["frontier"] = found
        return report

    def sweep(self, reference: StrategyRun) -> list[dict[str, Any]]:
        """Collective at each agent ratio (SWEEP_RATIOS) for both master choices, each variant
        under a cache salt of its own, measured against `reference`."""
        rows = []
        base = self.cfg
        for master in MASTER_CHOICES:
            for ratio in SWEEP_RATIOS:
                cfg = replace(base, master=master, agent_ratio=ratio)
                row = self.measure("collective", cfg, f":{master}:{ratio}", reference)
                rows.append(sweep_row(base.policy, ratio, f"collective_{master}", row))
        return rows

    def measure(
        self, name: str, cfg: AllGatherBenchConfig, variant: str, reference: StrategyRun
    ) -> dict[str, Any]:
        """Strategy `name`'s summary under `cfg` and salt `variant` (the bench keeps its own)."""
        base, self.cfg, self.variant = self.cfg, cfg, variant
        try:
            return summary_of(self.run(name), reference)
        finally:
            self.cfg, self.variant = base, ""

    def run(self, name: str) -> StrategyRun:
        from vllm import SamplingParams

        self.progress(name)
        run = StrategyRun(name)
        masters = 0
        mirrors = 0
        matching = 0
        for r, turns in enumerate(self.rounds):
            requests = [self._request(name, r, t, self.cfg, self.variant) for t in turns]
            started = time.perf_counter()
            outs = self._generate(requests, SamplingParams(temperature=0, max_tokens=1))
            run.add(r, seconds=time.perf_counter() - started)
            for a, out in enumerate(outs):
                stats = out.kv_transfer_params["kmesh"]
                recovery = stats.get("recovery") or {}
                run.add(r, computed=computed_of(stats["computed_tokens"], recovery))
                run.fallbacks += int(recovery.get("fell_back", False))
                if "quality" in stats:  # what served its quality target, as the bench reports it
                    run.extra["quality_served"] = stats["quality"]["served"]
                if recovery.get("deviation") is not None:
                    run.deviations[(r, a)] = recovery["deviation"]
                masters += recovery.get("master_bytes", 0)
                mirrors += recovery.get("mirror_bytes", 0)
            if r > 0:
                run.kv_bytes_per_agent += self._output_bytes(r)
                self._measure(run, r, requests)
            if r + 1 < len(self.rounds) and any(k and k.get("keep_output") for _, k in requests):
                matching += self._author(requests, turns)
        if matching:
            run.extra["kept_outputs_matching_trace"] = round(
                matching / sum(len(t) for t in self.rounds[:-1]), 4
            )
        if name == "collective":
            agents = max(len(turns) for turns in self.rounds)
            run.kv_bytes_per_agent += masters / agents
            # What a store would keep of the rounds (issue: group state in the store): the
            # masters and every agent's mirror (indices + block-sparse diff).
            run.extra |= {"kv_bytes_master": masters, "kv_bytes_mirror_per_agent": mirrors / agents}
        return run

    def _measure(self, run: StrategyRun, r: int, requests: list[tuple[dict, dict | None]]) -> None:
        """The first position's distribution and the greedy continuation of round r's prompts
        (keeping no outputs: what is measured must not feed later rounds)."""
        from vllm import SamplingParams

        requests = [
            (prompt, None if k is None else {n: x for n, x in k.items() if n != "keep_output"})
            for prompt, k in requests
        ]
        for a, out in enumerate(self._generate(requests, first_token_params())):
            run.logits[(r, a)] = first_token_logits(out, self.vocab_size)
        greedy = SamplingParams(temperature=0, max_tokens=self.cfg.greedy_tokens, ignore_eos=True)
        for a, out in enumerate(self._generate(requests, greedy)):
            run.greedy[(r, a)] = list(out.outputs[0].token_ids)

    def _warm_up(self) -> None:
        """Run KMesh's recovery once, untimed, under salts of its own (per-request and a round's
        master), so that no strategy's timing carries the worker's first use of the executor."""
        from vllm import SamplingParams

        r = min(1, len(self.rounds) - 1)
        turn = self.rounds[r][0]
        requests = [
            self._request(name, r, turn, self.cfg, ":warm-up")
            for name in ("per_request", "collective")
        ]
        self._generate(requests, SamplingParams(temperature=0, max_tokens=1))

    def _author(self, requests: list[tuple[dict, dict | None]], turns: list[AgentTurn]) -> int:
        """Generate the round's outputs from its prompts (greedy, untimed), the connector
        keeping their KV; how many are the trace's (only those are found by later readers)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.workload.output_tokens)
        outs = self._generate(requests, params)
        return sum(
            tuple(out.outputs[0].token_ids) == turn.output_ids
            for out, turn in zip(outs, turns, strict=True)
        )

    def _generate(self, requests: list[tuple[dict, dict | None]], params: Any) -> list[Any]:
        return generate(self.llm, requests, params)

    def _request(
        self, name: str, r: int, turn: AgentTurn, cfg: AllGatherBenchConfig, variant: str
    ) -> tuple[dict, dict | None]:
        """The prompt (token ids, cache salt) and the kmesh object of one agent turn."""
        salt, kmesh = strategy_request(name, r, turn, cfg, self.workload.agents, variant)
        prompt: dict[str, Any] = {"prompt_token_ids": list(turn.prompt.token_ids)}
        if salt is not None:
            prompt["cache_salt"] = salt
        return prompt, kmesh

    def closed_loops(self, tokenizer: Any, loops: Loops) -> dict[str, dict[str, list[float]]]:
        """bench/allgather/closed_loop.py through this engine, each label under salts of its own."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.workload.output_tokens)

        def generate(label: str, r: int, turns: list[AgentTurn]) -> list[Said]:
            name, cfg = loops[label]
            variant = f":closed-loop:{label}"
            outs = self._generate([self._request(name, r, t, cfg, variant) for t in turns], params)
            said = []
            for out in outs:
                stats = out.kv_transfer_params["kmesh"]
                computed = computed_of(stats["computed_tokens"], stats.get("recovery"))
                said.append(Said(list(out.outputs[0].token_ids), computed))
            return said

        outputs = run_closed_loop(self.workload, tokenizer, list(loops), generate, self.progress)
        return closed_loop_summary(outputs)

    def _output_bytes(self, r: int) -> int:
        """Round r - 1's outputs, as round r's prompts hold them, in every agent's pages."""
        outputs = {output_segment_id(r - 1, a) for a in range(self.workload.agents)}
        segments = self.rounds[r][0].prompt.segments
        tokens = sum(len(s.token_ids) for s in segments if s.segment_id in outputs)
        return tokens * self.kv_bytes_per_token


def run_vllm_allgather_bench(
    turns: Sequence[AgentTurn],
    cfg: AllGatherBenchConfig,
    workload: AllGatherConfig,
    model: str | None = None,
    block_size: int | None = None,
    sweep: bool = False,
    closed_loop: bool = False,
    frontier: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Start vLLM with KMeshConnector on the model folder (pages of `block_size` tokens,
    default DEFAULT_BLOCK_SIZE; its worker attaches recovery), run the four strategies."""
    import json
    from pathlib import Path

    from vllm import LLM

    from kmesh.compute.config import ModelConfig
    from kmesh.compute.fingerprint import model_fingerprint
    from kmesh.compute.loader import load_tokenizer, resolve_model_dir
    from kmesh.vllm.config import (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_KV_CACHE_BYTES,
        vllm_engine_kwargs,
        workload_context,
    )

    path = resolve_model_dir(model)
    hf = json.loads((Path(path) / "config.json").read_text())
    description = ModelConfig.from_hf(hf)
    kv_bytes_per_token = description.kv_bytes_per_token("float32")
    cfg = cfg.for_model(description)
    progress("starting vLLM with KMeshConnector")
    longest = max(len(t.prompt.token_ids) for t in turns) + cfg.greedy_tokens
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    # NOTE: room for a whole round's prompts and the previous round's (each agent's transcript
    # hit): a smaller cache evicts transcripts between rounds and measures capacity, not reuse.
    rounds = group_rounds(turns)
    widest = max(sum(len(t.prompt.token_ids) + cfg.greedy_tokens for t in r) for r in rounds)
    kv_cache_bytes = max(DEFAULT_KV_CACHE_BYTES, 2 * widest * kv_bytes_per_token)
    kwargs = vllm_engine_kwargs(
        path,
        max_model_len=workload_context(description, longest),
        block_size=block_size,
        kv_cache_bytes=kv_cache_bytes,
        max_logprobs=-1,
    )
    llm = LLM(**kwargs)
    try:
        bench = VllmAllGatherBench(
            llm, turns, workload, cfg, hf["vocab_size"], kv_bytes_per_token, block_size, progress
        )
        tokenizer = None
        if closed_loop or frontier:
            tokenizer = load_tokenizer(path)
        return bench.report(model_fingerprint(str(path)), sweep, tokenizer, closed_loop, frontier)
    finally:
        llm.llm_engine.engine_core.shutdown()
