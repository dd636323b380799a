"""The vLLM side of tests/vllm/test_activated.py, run as its own process (vLLM spawns workers, so
this needs a main guard): `python tests/vllm/activated_job.py OUT_DIR`. Writes OUT_DIR/result.json.

Two agents, each under its own trained activated adapter, read one shared context through vLLM
with KMeshConnector and a store (the bench's code path, bench/lora/vllm.py); the reference
engine's own full prefill of each agent under its activated adapter is the reference. Then the
same prompts under the plain adapters, under the same cache_salt: they must find no base state.
"""

import json
import sys
from pathlib import Path

CONTEXT_TOKENS = 256
AGENTS = 2


def main(out_dir: Path) -> None:
    from vllm.lora.request import LoRARequest

    from kmesh.adapters.prepare import ensure_adapters
    from kmesh.bench.lora.run import LoraBench, LoraBenchConfig
    from kmesh.bench.lora.vllm import VllmLoraBench, start_lora_engine
    from kmesh.bench.quality import next_token_kl
    from kmesh.compute.loader import load_model
    from kmesh.compute.lora import load_adapter
    from kmesh.store.process import start_store

    model = load_model(None)
    plain_dirs = ensure_adapters("lora", AGENTS)
    activated_dirs = ensure_adapters("activated", AGENTS)
    plain = [load_adapter(p) for p in plain_dirs]
    activated = [load_adapter(p) for p in activated_dirs]
    cfg = LoraBenchConfig(agents=(AGENTS,), context_tokens=CONTEXT_TOKENS, greedy_tokens=16)
    bench = LoraBench(model, plain, activated, cfg)
    reference = bench.exact(AGENTS, activated, prefix_caching=False)
    store = start_store(out_dir, capacity="1G")
    try:
        llm = start_lora_engine(bench, store.socket)
        try:
            on_vllm = VllmLoraBench(llm, bench, plain_dirs, activated_dirs, model.config.vocab_size)
            run = on_vllm.activated(AGENTS)
            prompts = [bench.context + bench.own_tokens(i, a) for i, a in enumerate(activated)]
            loras = [
                LoRARequest(a.name, 1 + i, str(p))
                for i, (a, p) in enumerate(zip(plain, plain_dirs, strict=True))
            ]
            plain_run = on_vllm.run(prompts, loras, f"kmesh-bench-lora:activated:{AGENTS}")
        finally:
            llm.llm_engine.engine_core.shutdown()
    finally:
        store.stop()
    result = {
        "context_tokens": len(bench.context),
        "prompt_tokens": [len(p) for p in prompts],
        "own_tokens": [len(bench.own_tokens(i, a)) for i, a in enumerate(activated)],
        "activated": {"greedy": run.greedy, "stats": run.extra["agent_stats"]},
        "reference_greedy": reference.greedy,
        "plain_same_salt": {"stats": plain_run.extra["agent_stats"]},
        "first_token_kl": next_token_kl(reference.logits, run.logits).tolist(),
    }
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
