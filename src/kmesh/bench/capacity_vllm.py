"""vLLM's strategies of `kmesh bench capacity`, in their own process (vLLM spawns workers):
`python -m kmesh.bench.capacity_vllm SPEC.json`.

One vLLM instance with a KV cache of the budget (`vanilla`: prefix caching only), or half of it
plus vLLM's own CPU offloading of the other half (`vanilla_offload`: SimpleCPUOffloadConnector),
runs the workload (the All-Gather council, workloads/allgather.py, or agent trajectories,
workloads/trajectory.py: a turn is a round) at each agent count, closed loop: each round
its prompts are answered at once (greedy, `output_tokens`): `computed` is the prompt tokens
minus vLLM's prefix-cache hit, `seconds` the last request's first-token latency (the round's
prefill, with the decode steps vLLM interleaves), `round_seconds` the whole call; the answers
make the next round's prompts. The prefix cache is reset between agent counts. The
vanilla run's rounds are saved as traces that KMesh's strategies replay. A strategy vLLM cannot
start writes its error instead.
"""

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    from kmesh.vllm.config import vllm_engine_kwargs

    budget = spec["budget_bytes"]
    kwargs = vllm_engine_kwargs(
        spec["model"], connector=False, kv_cache_bytes=budget, max_model_len=spec["max_model_len"]
    )
    if spec["connector"] is not None:
        kwargs["kv_cache_memory_bytes"] = budget // 2
        kwargs["kv_transfer_config"] = {
            "kv_connector": spec["connector"],
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": budget - budget // 2},
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
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from kmesh.compute.loader import resolve_model_dir
    from kmesh.workloads.trace import save_trace

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(spec["model"]))
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


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    try:
        result = run(spec)
    except Exception as error:  # a strategy vLLM cannot run on this build: say why
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    Path(spec["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
