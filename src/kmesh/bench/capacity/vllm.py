"""vLLM's strategies of `kmesh bench capacity`, in their own process (vLLM spawns workers):
`python -m kmesh.bench.capacity.vllm SPEC.json`.

One vLLM instance with a KV cache of the budget (`vanilla`: prefix caching only), or half of it (at
least one request's) plus vLLM's own CPU offloading of the rest (`vanilla_offload`:
SimpleCPUOffloadConnector, else OffloadingConnector; bench/capacity/sizing.py sizes both) runs the
workload (the All-Gather council, workloads/allgather.py, or agent trajectories,
workloads/trajectory.py: a turn is a round) at each agent count, closed loop: each round its prompts
are answered at once (greedy, `output_tokens`): `computed` is the prompt tokens minus vLLM's
prefix-cache hit, `seconds` the last request's first-token latency (the round's prefill, with the
decode steps vLLM interleaves), `round_seconds` the whole call; the answers make the next round's
prompts. The prefix cache is reset between agent counts. The vanilla run's rounds are saved as
traces that KMesh's strategies replay. A strategy vLLM cannot start writes its error instead.

With `replay` (a trace) the process is KMesh through vLLM (`replay`): vLLM with KMeshConnector
on a store the bench started, a KV cache of one request (`kv_cache_bytes`), the trace's rounds
sent with the All-Gather bench's collective requests (bench/allgather/strategy_requests.py:
segments, each round from round 1 on declared, each member's `next_use`, dropped unless `declare`).
`computed` is what vLLM computed plus what recovery computed, `restored_bytes` what the members'
transcripts read from the store.
"""

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    from kmesh.vllm.config import vllm_engine_kwargs

    if spec.get("replay"):
        return vllm_engine_kwargs(
            spec["model"],
            store=spec["store"],
            kv_cache_bytes=spec["kv_cache_bytes"],
            max_model_len=spec["max_model_len"],
        )
    kwargs = vllm_engine_kwargs(
        spec["model"],
        connector=False,
        kv_cache_bytes=spec["kv_cache_bytes"],
        max_model_len=spec["max_model_len"],
    )
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": spec["connector"],
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": spec["offload_bytes"]},
        }
    return kwargs


def workload(spec: dict[str, Any], agents: int, tokenizer: Any) -> tuple[Any, Any]:
    """(config, prompt builder) of the spec's workload at `agents` agents."""
    from kmesh.workloads.allgather import AllGatherConfig, Council
    from kmesh.workloads.trajectory import Trajectories, TrajectoryConfig

    if spec["workload"] == "trajectory":
        cfg = TrajectoryConfig(
            agents, spec["rounds"], spec["seed"], spec["output_tokens"], spec["tool_tokens"]
        )
        return cfg, Trajectories(cfg, tokenizer)
    council = AllGatherConfig(
        agents, spec["rounds"], spec["order"], spec["seed"], spec["output_tokens"]
    )
    return council, Council(council, tokenizer)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    from kmesh.compute.loader import load_tokenizer, resolve_model_dir
    from kmesh.workloads.trace import save_trace

    tokenizer = load_tokenizer(resolve_model_dir(spec["model"]))
    llm = LLM(**engine_kwargs(spec), disable_log_stats=False)  # stats: first-token latencies
    answer = SamplingParams(temperature=0, max_tokens=spec["output_tokens"])
    runs = []
    for agents in spec["agents"]:
        cfg, council = workload(spec, agents, tokenizer)
        llm.reset_prefix_cache()
        rounds, turns = [], []
        for _ in range(spec["rounds"]):
            prompts = council.prompts()
            inputs = [TokensPrompt(prompt_token_ids=list(p.token_ids)) for p in prompts]
            started = time.perf_counter()
            outs = llm.generate(inputs, answer, use_tqdm=False)
            seconds = time.perf_counter() - started
            computed = sum(len(o.prompt_token_ids or ()) - (o.num_cached_tokens or 0) for o in outs)
            # Every prompt arrives at once: the last first token ends the round's prefill.
            prefill = max(o.metrics.first_token_latency for o in outs if o.metrics is not None)
            turns += council.answer(prompts, [o.outputs[0].token_ids for o in outs])
            rounds.append({"computed": computed, "seconds": prefill, "round_seconds": seconds})
        if spec.get("traces"):
            trace = Path(spec["traces"]) / f"trace-{agents}.jsonl"
            save_trace(trace, cfg, spec["fingerprint"], turns)
        runs.append({"agents": agents, "rounds": rounds})
    llm.llm_engine.engine_core.shutdown()
    return {"runs": runs}


def replay(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    from kmesh.bench.allgather.config import AllGatherBenchConfig
    from kmesh.bench.allgather.strategy_requests import strategy_request
    from kmesh.workloads.allgather import group_rounds
    from kmesh.workloads.trace import load_trace

    rounds = group_rounds(load_trace(Path(spec["replay"]))[2])
    agents = len(rounds[0])
    bench = AllGatherBenchConfig(agent_ratio=spec["agent_ratio"])
    llm = LLM(**engine_kwargs(spec))
    # Two tokens: the transcript is the prompt's, and a request that ends in the step its
    # recovery ran pins nothing (kmesh/vllm/scheduler_side.py::pin_transcripts).
    answer = SamplingParams(temperature=0, max_tokens=2)
    out = []
    for r, turns in enumerate(rounds):
        prompts, params = [], []
        for turn in turns:
            salt, kmesh = strategy_request("collective", r, turn, bench, agents, ":capacity")
            assert kmesh is not None
            if not spec["declare"]:
                kmesh.pop("next_use", None)
            assert salt is not None
            prompts.append(
                TokensPrompt(prompt_token_ids=list(turn.prompt.token_ids), cache_salt=salt)
            )
            params.append(answer.clone())
            params[-1].extra_args = {"kv_transfer_params": {"kmesh": kmesh}}
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = [(o.kv_transfer_params or {})["kmesh"] for o in outs]
        recovery = [s.get("recovery") or {} for s in stats]
        out.append(
            {
                "computed": sum(s["computed_tokens"] for s in stats)
                + sum(r.get("computed_tokens", 0.0) for r in recovery),
                "restored_tokens": sum(r.get("restored_tokens", 0) for r in recovery),
                "restored_bytes": sum(r.get("restored_bytes", 0) for r in recovery),
                "seconds": time.perf_counter() - started,
            }
        )
    llm.llm_engine.engine_core.shutdown()
    return {"runs": [{"agents": agents, "rounds": out}]}


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    try:
        result = replay(spec) if spec.get("replay") else run(spec)
    except Exception as error:  # a strategy vLLM cannot run on this build: say why
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    Path(spec["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
