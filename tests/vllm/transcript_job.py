"""The vLLM side of tests/vllm/test_transcripts.py, run as its own process (vLLM spawns workers):
`python tests/vllm/transcript_job.py OUT_DIR [AGENT_RATIO]`. Writes OUT_DIR/result.json.

A council of three agents (kmesh/workloads/allgather.py, the collective strategy's requests:
segments, a family, each round declared) on two "machines": two stores, each with its own
shared memory tier, in front of one remote tier (a mooncake_master on loopback ports). Instance
A, on store A, runs rounds 1 and 2 of every agent, then agent 1's round 3; A stops, and store A
has written everything through. Instance B, started fresh on store B, runs agent 1's round 3
again (its transcript comes through the remote tier), then the same prompt under another salt.
With AGENT_RATIO (default 0, what the test runs), each mirrored member recomputes that share of
its mirrored blocks (kv_deviation): its pieces carry diff blocks.
"""

import json
import sys
import time
from pathlib import Path
from typing import Any

AGENTS = 3
OUTPUT_TOKENS = 24


def main(out_dir: Path, agent_ratio: float = 0.0) -> None:
    from vllm import LLM, SamplingParams

    from kmesh.bench.allgather.config import AllGatherBenchConfig
    from kmesh.bench.allgather.strategy_requests import strategy_request
    from kmesh.store import StoreClient
    from kmesh.store.process import MasterProcess, start_store
    from kmesh.vllm.config import vllm_engine_kwargs
    from kmesh.workloads.allgather import AgentTurn, AllGatherConfig, Council

    policy = "kv_deviation" if agent_ratio else "none"
    cfg = AllGatherBenchConfig(policy=policy, agent_ratio=agent_ratio, gate=None)
    greedy = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS)
    master = MasterProcess(out_dir)
    master.start()
    stores = []
    for name in ("a", "b"):
        (out_dir / name).mkdir()
        stores.append(start_store(out_dir / name, capacity="1G", remote=master, remote_lend="1G"))
    result: dict[str, Any] = {}
    try:
        kwargs = vllm_engine_kwargs(store=stores[0].socket, max_model_len=4096)

        def run(llm: Any, r: int, prompts: list[Any], agents: list[int], salt: str = "") -> list:
            requests, params = [], []
            for a in agents:
                turn = AgentTurn(r, a, prompts[a], (), "")
                cache_salt, kmesh = strategy_request("collective", r, turn, cfg, AGENTS, salt)
                requests.append({"prompt_token_ids": list(turn.prompt.token_ids)})
                requests[-1]["cache_salt"] = cache_salt
                p = greedy.clone()
                p.extra_args = {"kv_transfer_params": {"kmesh": kmesh}}
                params.append(p)
            outs = llm.generate(requests, params, use_tqdm=False)
            return [
                {"ids": list(o.outputs[0].token_ids), **o.kv_transfer_params["kmesh"]} for o in outs
            ]

        first = LLM(**kwargs)
        council = Council(
            AllGatherConfig(agents=AGENTS, rounds=3, order="shuffle"), first.get_tokenizer()
        )
        for r in range(2):
            prompts = council.prompts()
            outs = run(first, r, prompts, list(range(AGENTS)))
            result[f"round{r}"] = outs
            council.answer(prompts, [o["ids"] for o in outs])
        last = council.prompts()
        result["prompt_tokens"] = len(last[1].token_ids)
        result["instruction_tokens"] = len(last[1].segments[-1].token_ids)
        [result["first"]] = run(first, 2, last, [1])
        with StoreClient(stores[0].socket) as client:
            # The members' transcripts, declared for their next round (`next_use`).
            result["pinned_while_a_runs"] = client.stats()["pinned"]
        first.llm_engine.engine_core.shutdown()
        del first
        with StoreClient(stores[0].socket) as client:
            result["pinned_after_a_stopped"] = client.stats()["pinned"]
            while client.stats()["remote_pending"]:  # A's pieces written through
                time.sleep(0.05)

        second = LLM(**vllm_engine_kwargs(store=stores[1].socket, max_model_len=4096))
        [result["second"]] = run(second, 2, last, [1])
        [result["other_salt"]] = run(second, 2, last, [1], salt=":another")
        second.llm_engine.engine_core.shutdown()
    finally:
        for store in stores:
            store.stop()
        master.stop()
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(float(a) for a in sys.argv[2:3]))
