"""`kmesh bench lora`: N agents, each under its own adapter, read one shared context.

Three ways, run side by side on the same workload (workloads/shared_context.py):
- exact: plain adapters, the adapter in every key (what vLLM does): each agent computes the
  whole context under its adapter. The reference for `residual`.
- activated: activated adapters (the adapter applies from the agent's invocation on). The context
  is a declared base-model trunk computed once; each agent forks it under its adapter. Exact:
  compared with each agent's own full prefill under its activated adapter (computed in the same
  run, not counted): `outputs_identical_to_exact`.
- residual: the plain adapters again; the context's base KV once plus each adapter's low-rank
  residual (recovery/adapter_residual.py), gated; a refused agent computes the context exactly.

Accounting, per agent count N:
- computed_tokens: prompt tokens run through the model (the gate's check tokens included;
  generated tokens not).
- kv_bytes_per_agent: state held for an agent's prompt, with shared state counted once over the
  N agents: exact (context + own tokens) KV; activated context KV / N + own KV; residual
  context KV / N + its residual + KV of its check and own tokens. `kv_bytes_private_per_agent`
  leaves the shared part out.
- prefill_seconds: from the first prefill to the last agent's first token (engine strategies),
  or the prefill work itself (residual); wall time on a noisy machine, a trend.
- quality: the first generated token's distribution and 32 greedy tokens against exact (for
  activated: against its own full prefill).
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kmesh.bench.quality import Quality, greedy_decode, next_token_kl
from kmesh.compute.executor import DenseKV, SequenceInput
from kmesh.compute.loader import LoadedModel
from kmesh.compute.lora import LoraAdapter, LoraUse
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.errors import InvalidRequestError
from kmesh.recovery.adapter_residual import ResidualConfig, adapter_context, compute_base
from kmesh.workloads.shared_context import agent_tokens, shared_context

STRATEGIES = ("exact", "activated", "residual")


@dataclass(frozen=True, slots=True)
class LoraBenchConfig:
    agents: tuple[int, ...] = (4, 8, 16)
    context_tokens: int = 2048
    seed: int = 0
    greedy_tokens: int = 32
    block_size: int = 16
    residual: ResidualConfig = field(default_factory=ResidualConfig)

    def __post_init__(self) -> None:
        if not self.agents or min(self.agents) < 1:
            raise InvalidRequestError(f"agents must be positive counts, got {self.agents}")
        if self.context_tokens < 64:
            raise InvalidRequestError(
                f"--context-tokens must be at least 64, got {self.context_tokens}"
            )
        if self.greedy_tokens < 1:
            raise InvalidRequestError("greedy_tokens must be >= 1")


@dataclass(slots=True)
class LoraRun:
    computed_tokens: int
    kv_bytes: list[int]  # per agent, shared state not included
    shared_bytes: int  # counted once over the agents
    prefill_seconds: float
    logits: torch.Tensor  # [agents, vocab], the first generated token's
    greedy: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self, agents: int, quality: Quality) -> dict[str, Any]:
        private = sum(self.kv_bytes) / agents
        return {
            "agents": agents,
            "computed_tokens": self.computed_tokens,
            "kv_bytes_per_agent": round(self.shared_bytes / agents + private),
            "kv_bytes_private_per_agent": round(private),
            "prefill_seconds": round(self.prefill_seconds, 3),
            "quality": quality.as_dict(),
            **self.extra,
        }


class LoraBench:
    def __init__(
        self,
        model: LoadedModel,
        plain: Sequence[LoraAdapter],
        activated: Sequence[LoraAdapter],
        cfg: LoraBenchConfig,
    ) -> None:
        need = max(cfg.agents)
        if len(plain) < need or len(activated) < need:
            raise InvalidRequestError(
                f"{need} agents need {need} adapters of each kind, got {len(plain)} plain and "
                f"{len(activated)} activated"
            )
        self.model = model
        self.cfg = cfg
        self.plain = list(plain)
        self.activated = list(activated)
        executor = model.executor
        c = executor.config
        self.bytes_per_token = (
            c.num_layers * 2 * c.num_kv_heads * c.head_dim * executor.dtype.itemsize
        )
        notes_engine = Engine(executor, model.fingerprint, kv_cache_tokens=16384)
        self.context = shared_context(notes_engine, model.tokenizer, cfg.context_tokens, cfg.seed)
        self.params = SamplingParams(max_tokens=cfg.greedy_tokens, stop_token_ids=())

    def own_tokens(self, agent: int, adapter: LoraAdapter) -> tuple[int, ...]:
        return agent_tokens(self.model.tokenizer, agent, adapter.invocation_tokens)

    def _engine(self, adapters: Sequence[LoraAdapter], agents: int, **options: Any) -> Engine:
        per_agent = self.cfg.context_tokens + 64 + self.cfg.greedy_tokens
        return Engine(
            self.model.executor,
            self.model.fingerprint,
            block_size=self.cfg.block_size,
            kv_cache_tokens=(agents + 1) * per_agent,
            adapters=adapters,
            **options,
        )

    def _collect(self, engine: Engine, requests: list[Request], agents: int) -> LoraRun:
        """Run the requests (a retained trunk first, if any, then one per agent)."""
        outputs = engine.generate(requests)
        agents_out = outputs[-agents:]
        # Forks start when their trunk is retained: its seconds, then theirs.
        trunk_seconds = outputs[0].stats.seconds if len(outputs) > agents else 0.0
        logits = [out.logits[0] for out in agents_out if out.logits is not None]
        return LoraRun(
            computed_tokens=sum(out.stats.computed_tokens for out in outputs),
            kv_bytes=[],
            shared_bytes=0,
            prefill_seconds=trunk_seconds
            + max(out.stats.first_token_seconds for out in agents_out),
            logits=torch.stack(logits),
            greedy=[list(out.output_ids) for out in agents_out],
        )

    def exact(
        self, agents: int, adapters: Sequence[LoraAdapter], prefix_caching: bool = True
    ) -> LoraRun:
        """Every agent's whole prompt under its adapter. With prefix caching plain adapters
        share nothing (the keys differ by adapter); without it (the reference for activated
        adapters, whose context blocks are base-keyed) no agent reuses another's blocks."""
        engine = self._engine(adapters[:agents], agents, prefix_caching=prefix_caching)
        requests = [
            Request(
                f"agent-{i}",
                self.context + self.own_tokens(i, a),
                self.params,
                adapter=a.name,
                keep_logits=True,
            )
            for i, a in enumerate(adapters[:agents])
        ]
        run = self._collect(engine, requests, agents)
        run.kv_bytes = [len(r.prompt_ids) * self.bytes_per_token for r in requests]
        return run

    def activated_shared(self, agents: int) -> LoraRun:
        """The context as a declared base trunk, computed once; each agent forks it."""
        adapters = self.activated[:agents]
        engine = self._engine(adapters, agents)
        engine.declare_family("agents", "context", agents)
        requests = [Request("context", self.context, None, retain=True)]
        requests += [
            Request(
                f"agent-{i}",
                self.own_tokens(i, a),
                self.params,
                parent_id="context",
                adapter=a.name,
                keep_logits=True,
            )
            for i, a in enumerate(adapters)
        ]
        run = self._collect(engine, requests, agents)
        run.shared_bytes = len(self.context) * self.bytes_per_token
        run.kv_bytes = [len(r.prompt_ids) * self.bytes_per_token for r in requests[1:]]
        return run

    def residual(self, agents: int, cfg: ResidualConfig) -> LoraRun:
        executor = self.model.executor
        adapters = self.plain[:agents]
        n = len(self.context)
        start = time.perf_counter()
        base = compute_base(executor, self.context, adapters)
        computed = n
        contexts: list[DenseKV] = []
        deviations = []
        refused = 0
        kv_bytes = []
        for adapter in adapters:
            outcome = adapter_context(executor, base, adapter, cfg)
            computed += outcome.computed_tokens
            deviations.append(round(outcome.deviation, 4))
            kv = outcome.kv
            private = outcome.residual_bytes + outcome.computed_tokens * self.bytes_per_token
            if kv is None:  # the gate's fallback: the context exactly under the adapter
                refused += 1
                tokens = torch.tensor(self.context)
                [out] = executor.forward(
                    [SequenceInput(tokens, torch.arange(n), lora=LoraUse(adapter, 0))]
                )
                kv = out.as_context(torch.arange(n))
                computed += n
                private = n * self.bytes_per_token
            contexts.append(kv)
            kv_bytes.append(private)
        owns = [self.own_tokens(i, a) for i, a in enumerate(adapters)]
        outputs = executor.forward(
            [
                SequenceInput(
                    torch.tensor(own), torch.arange(n, n + len(own)), kv, lora=LoraUse(a, 0)
                )
                for own, kv, a in zip(owns, contexts, adapters, strict=True)
            ]
        )
        logits = executor.logits(torch.stack([out.hidden[-1] for out in outputs]))
        seconds = time.perf_counter() - start
        computed += sum(len(own) for own in owns)
        full = [
            DenseKV(
                torch.arange(n + len(own)),
                [torch.cat((k, new)) for k, new in zip(kv.k, out.k, strict=True)],
                [torch.cat((v, new)) for v, new in zip(kv.v, out.v, strict=True)],
            )
            for own, kv, out in zip(owns, contexts, outputs, strict=True)
        ]
        greedy = greedy_decode(
            executor, full, logits, self.cfg.greedy_tokens, [LoraUse(a, 0) for a in adapters]
        )
        return LoraRun(
            computed_tokens=computed,
            kv_bytes=[
                b + len(own) * self.bytes_per_token for b, own in zip(kv_bytes, owns, strict=True)
            ],
            shared_bytes=n * self.bytes_per_token,
            prefill_seconds=seconds,
            logits=logits,
            greedy=greedy,
            extra={"gate_deviation": deviations, "gate_refused": refused},
        )


def run_lora_bench(
    bench: LoraBench, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    cfg, model = bench.cfg, bench.model
    strategies: dict[str, dict[str, list[dict[str, Any]]]] = {s: {"runs": []} for s in STRATEGIES}
    for agents in cfg.agents:
        progress(f"{agents} agents: exact")
        exact = bench.exact(agents, bench.plain)
        strategies["exact"]["runs"].append(exact.row(agents, quality_against(exact, exact)))
        progress(f"{agents} agents: activated (and its own exact prefill, for the comparison)")
        shared = bench.activated_shared(agents)
        own_exact = bench.exact(agents, bench.activated, prefix_caching=False)
        row = shared.row(agents, quality_against(own_exact, shared))
        row["outputs_identical_to_exact"] = (
            sum(a == b for a, b in zip(shared.greedy, own_exact.greedy, strict=True)) / agents
        )
        row["exact_computed_tokens"] = own_exact.computed_tokens
        strategies["activated"]["runs"].append(row)
        progress(f"{agents} agents: residual")
        residual = bench.residual(agents, cfg.residual)
        row = residual.row(agents, quality_against(exact, residual))
        row["agent_kl"] = [
            float(f"{kl:.4g}") for kl in next_token_kl(exact.logits, residual.logits)
        ]
        strategies["residual"]["runs"].append(row)
    return {
        "config": {
            "agents": list(cfg.agents),
            "context_tokens": len(bench.context),
            "seed": cfg.seed,
            "greedy_tokens": cfg.greedy_tokens,
            "block_size": cfg.block_size,
            "check_tokens": cfg.residual.check_tokens,
            "max_deviation": cfg.residual.max_deviation,
            "model": model.fingerprint,
            "adapters": {
                "plain": [a.name for a in bench.plain],
                "activated": [a.name for a in bench.activated],
            },
        },
        "strategies": strategies,
    }


def quality_against(reference: LoraRun, run: LoraRun) -> Quality:
    """The run's first-token distributions and greedy continuations against the reference's."""
    return Quality.measure(reference.logits, run.logits, reference.greedy, run.greedy)
