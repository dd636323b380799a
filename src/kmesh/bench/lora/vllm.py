"""`kmesh bench lora --engine vllm`: the agents of bench/lora/run.py through vLLM with
KMeshConnector.

The same context, questions and adapters as the reference engine's run, in one vLLM engine with
the connector on a store of its own (started on loopback and stopped):
- exact: plain adapters as vLLM serves them (the adapter in every block hash: nothing shared).
- activated: the activated adapters, each request named with its start
  (kmesh/vllm/activated.py::activated_lora_request), all agents sent at once: the first fills
  the context's base-model rows (KMesh's executor on vLLM's base layers) and publishes them under
  base keys, the others load them from the store and fill their own rows up to their start.
- residual: not built in vLLM (docs/design/vllm-integration.md, section 10); its runs are empty.

Each strategy and agent count runs under a cache_salt of its own (nothing crosses runs). The
references are the reference engine's, computed once for the most agents (agent i's prompt is the
same at every count): exact plain adapters for `exact` (the engines agree), and each agent's own
full prefill under its activated adapter for `activated`.

Accounting: computed_tokens are prompt tokens run through a model, by vLLM or by KMesh's executor
(its base-model fill); prefill_seconds the wall time of the call that computes the prompts and
one token; KV/agent the bytes vLLM's pages hold for an agent's prompt (dense: its attention reads
whole pages), with the store's shared copy of the base context given apart
(`store_bytes_shared`).
"""

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kmesh.bench.lora.run import LoraBench, LoraRun, quality_against
from kmesh.bench.vllm_logits import first_token_logits, first_token_params
from kmesh.compute.loader import resolve_model_dir
from kmesh.vllm.activated import activated_lora_request

NOT_BUILT = (
    "base + low-rank residual is not built in vLLM: its attention reads whole K/V pages and has "
    "no residual hook (docs/design/vllm-integration.md, section 10)"
)
STORE_CAPACITY = "2G"


class VllmLoraBench:
    def __init__(
        self,
        llm: Any,
        bench: LoraBench,
        plain_dirs: Sequence[Path],
        activated_dirs: Sequence[Path],
        vocab_size: int,
    ) -> None:
        self.llm = llm
        self.bench = bench
        self.plain_dirs = list(plain_dirs)
        self.activated_dirs = list(activated_dirs)
        self.vocab_size = vocab_size

    def exact(self, agents: int) -> LoraRun:
        from vllm.lora.request import LoRARequest

        prompts, loras = [], []
        for i in range(agents):
            adapter, folder = self.bench.plain[i], self.plain_dirs[i]
            prompts.append(self.bench.context + self.bench.own_tokens(i, adapter))
            loras.append(LoRARequest(adapter.name, 1 + i, str(folder)))
        return self.run(prompts, loras, f"kmesh-bench-lora:exact:{agents}")

    def activated(self, agents: int) -> LoraRun:
        prompts, loras = [], []
        for i in range(agents):
            adapter, folder = self.bench.activated[i], self.activated_dirs[i]
            prompt = self.bench.context + self.bench.own_tokens(i, adapter)
            prompts.append(prompt)
            loras.append(activated_lora_request(adapter.name, 1001 + i, folder, prompt))
        run = self.run(prompts, loras, f"kmesh-bench-lora:activated:{agents}")
        run.extra["store_bytes_shared"] = len(self.bench.context) * self.bench.bytes_per_token
        return run

    def warm_up(self) -> None:
        """Load every adapter and run the connector's base fill once, untimed, under a salt of
        its own, so that no strategy's seconds carry first uses."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        bench, inputs, loras = self.bench, [], []
        kinds = ((bench.plain, self.plain_dirs, 1), (bench.activated, self.activated_dirs, 1001))
        for adapters, dirs, first_id in kinds:
            for i, (adapter, folder) in enumerate(zip(adapters, dirs, strict=True)):
                prompt = bench.context[:64] + bench.own_tokens(i, adapter)
                inputs.append(TokensPrompt(prompt_token_ids=list(prompt), cache_salt="warm-up"))
                if adapter.activated:
                    loras.append(activated_lora_request(adapter.name, first_id + i, folder, prompt))
                else:
                    loras.append(LoRARequest(adapter.name, first_id + i, str(folder)))
        params = SamplingParams(temperature=0, max_tokens=1)
        self.llm.generate(inputs, params, lora_request=loras, use_tqdm=False)

    def run(self, prompts: list[tuple[int, ...]], loras: list[Any], salt: str) -> LoraRun:
        """Prefill and one token (timed), then the greedy continuation (its prompt's blocks are
        vLLM's local hits by then)."""
        from vllm import SamplingParams, TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=list(p), cache_salt=salt) for p in prompts]
        start = time.perf_counter()
        first = self.llm.generate(inputs, first_token_params(), lora_request=loras, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = [out.kv_transfer_params["kmesh"] for out in first]
        computed = sum(s["computed_tokens"] for s in stats)
        computed += sum(s.get("recovery", {}).get("computed_tokens", 0) for s in stats)
        greedy = SamplingParams(
            temperature=0, max_tokens=self.bench.cfg.greedy_tokens, ignore_eos=True
        )
        outs = self.llm.generate(inputs, greedy, lora_request=loras, use_tqdm=False)
        return LoraRun(
            computed_tokens=round(computed),
            kv_bytes=[len(p) * self.bench.bytes_per_token for p in prompts],
            shared_bytes=0,
            prefill_seconds=seconds,
            logits=torch.stack([first_token_logits(out, self.vocab_size) for out in first]),
            greedy=[list(out.outputs[0].token_ids) for out in outs],
            extra={"agent_stats": [{k: v for k, v in s.items() if k != "family"} for s in stats]},
        )


def run_vllm_lora_bench(
    bench: LoraBench,
    plain_dirs: Sequence[Path],
    activated_dirs: Sequence[Path],
    model: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """bench/lora/run.py's workload through vLLM (module docstring); the same JSON shape."""
    from kmesh.store.process import start_store

    cfg = bench.cfg
    most = max(cfg.agents)
    progress(f"reference engine: the {most} agents' exact prefills (the references)")
    exact_ref = bench.exact(most, bench.plain)
    activated_ref = bench.exact(most, bench.activated, prefix_caching=False)
    with tempfile.TemporaryDirectory(prefix="kmesh-lora-") as work:
        store = start_store(Path(work), capacity=STORE_CAPACITY)
        try:
            progress("starting vLLM with KMeshConnector and LoRA")
            llm = start_lora_engine(bench, store.socket, model)
            try:
                vocab = bench.model.config.vocab_size
                on_vllm = VllmLoraBench(llm, bench, plain_dirs, activated_dirs, vocab)
                on_vllm.warm_up()
                runs = {}
                for n in cfg.agents:
                    progress(f"{n} agents: exact, then activated")
                    runs[n] = (on_vllm.exact(n), on_vllm.activated(n))
                result = _report(bench, runs, exact_ref, activated_ref)
            finally:
                llm.llm_engine.engine_core.shutdown()
        finally:
            store.stop()
    return result


def start_lora_engine(bench: LoraBench, store: str, model: str | None = None) -> Any:
    """vLLM with KMeshConnector on `store`, LoRA enabled for the bench's adapters, room for the
    most agents' prompts twice (its worker attaches recovery)."""
    from vllm import LLM

    from kmesh.compute.config import ModelConfig
    from kmesh.vllm.config import vllm_engine_kwargs, workload_context

    most = max(bench.cfg.agents)
    per_agent = len(bench.context) + 128 + bench.cfg.greedy_tokens
    llm = LLM(
        **vllm_engine_kwargs(
            resolve_model_dir(model),
            store=store,
            max_model_len=workload_context(
                ModelConfig.from_folder(resolve_model_dir(model)), per_agent
            ),
            kv_cache_bytes=max(1 << 30, 2 * most * per_agent * bench.bytes_per_token),
            enable_lora=True,
            max_lora_rank=max(a.rank for a in [*bench.plain, *bench.activated]),
            max_loras=min(most, 16),
            max_cpu_loras=len(bench.plain) + len(bench.activated),  # none reloaded from disk
            max_logprobs=-1,
        )
    )
    return llm


def _report(
    bench: LoraBench,
    runs: dict[int, tuple[LoraRun, LoraRun]],
    exact_ref: LoraRun,
    activated_ref: LoraRun,
) -> dict[str, Any]:
    strategies: dict[str, dict[str, Any]] = {
        "exact": {"runs": []},
        "activated": {"runs": []},
        "residual": {"runs": [], "not_built": NOT_BUILT},
    }
    for agents, (exact, activated) in runs.items():
        ref = _first(exact_ref, agents)
        strategies["exact"]["runs"].append(exact.row(agents, quality_against(ref, exact)))
        own = _first(activated_ref, agents)
        row = activated.row(agents, quality_against(own, activated))
        row["outputs_identical_to_exact"] = (
            sum(a == b for a, b in zip(activated.greedy, own.greedy, strict=True)) / agents
        )
        row["exact_computed_tokens"] = sum(own.kv_bytes) // bench.bytes_per_token
        strategies["activated"]["runs"].append(row)
    return {
        "config": {
            "engine": "vllm",
            "agents": list(bench.cfg.agents),
            "context_tokens": len(bench.context),
            "seed": bench.cfg.seed,
            "greedy_tokens": bench.cfg.greedy_tokens,
            "model": bench.model.fingerprint,
            "adapters": {
                "plain": [a.name for a in bench.plain],
                "activated": [a.name for a in bench.activated],
            },
            "references": "the reference engine's exact prefills (exact: plain adapters; "
            "activated: each agent's own, no sharing)",
        },
        "strategies": strategies,
    }


def _first(run: LoraRun, agents: int) -> LoraRun:
    """The first `agents` agents of a reference run (their prompts do not depend on the count)."""
    return LoraRun(
        computed_tokens=0,
        kv_bytes=run.kv_bytes[:agents],
        shared_bytes=0,
        prefill_seconds=0.0,
        logits=run.logits[:agents],
        greedy=run.greedy[:agents],
    )
