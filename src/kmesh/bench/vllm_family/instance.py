"""One vLLM instance of `kmesh bench vllm-family`, in its own process (vLLM spawns workers):
`python -m kmesh.bench.vllm_family.instance SPEC.json`. SPEC["runs"] lists the runs it takes
part in, one after another in this process (one Python and vLLM import for all): for each, it
starts vLLM (with KMeshConnector and the store, or vanilla), says it is ready, waits for the
run's go file, sends all its requests at once, writes what each computed, reused and restored,
its outputs and its wall time, and shuts that engine down."""

import json
import sys
import time
from pathlib import Path
from typing import Any

GO_POLL_S = 0.05


def run(spec: dict[str, Any]) -> None:
    """Writes spec["result"] before shutting vLLM down: seconds of its generate call, wall
    clock at its start and end, and per request the stats, the first-token latency (from its
    arrival, i.e. the go signal: queueing, waiting for another instance and prefill) and the
    output ids."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from kmesh.vllm.config import vllm_engine_kwargs

    store = spec["store"]
    kwargs = vllm_engine_kwargs(spec["model"], store=store, connector=store is not None)
    llm = LLM(**kwargs, disable_log_stats=False)  # stats on: each output's first-token latency
    Path(spec["ready"]).touch()
    while not Path(spec["go"]).exists():
        time.sleep(GO_POLL_S)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=spec["max_tokens"],
            extra_args={"kv_transfer_params": {"kmesh": spec["kmesh"]}},
        )
        for _ in spec["prompts"]
    ]
    start = time.perf_counter()
    go = time.time()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False
    )
    seconds = time.perf_counter() - start
    end = time.time()
    requests = []
    for prompt, out in zip(spec["prompts"], outputs, strict=True):
        if store is not None:
            assert out.kv_transfer_params is not None, "KMeshConnector returns stats"
            stats = {k: v for k, v in out.kv_transfer_params["kmesh"].items() if k != "family"}
        else:  # vanilla vLLM: its own prefix-cache hit
            cached = out.num_cached_tokens or 0
            stats = {"prompt_tokens": len(prompt), "reused_tokens": cached, "restored_tokens": 0}
            stats["computed_tokens"] = len(prompt) - cached
        assert out.metrics is not None, "vLLM keeps per-request stats (disable_log_stats=False)"
        stats["first_token_seconds"] = out.metrics.first_token_latency
        requests.append({"output_ids": list(out.outputs[0].token_ids), **stats})
    Path(spec["result"]).write_text(
        json.dumps({"seconds": seconds, "started": go, "ended": end, "requests": requests})
    )
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    for one in json.loads(Path(sys.argv[1]).read_text())["runs"]:
        run(one)
