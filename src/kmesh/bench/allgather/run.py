"""`kmesh bench allgather`: one All-Gather trace, four ways to prefill it, measured against full.

Strategies, all replaying the same prompts (a trace from workloads/allgather.py):
- full: every prompt computed from scratch; the reference for quality.
- prefix: exact prefix reuse: each agent keeps its own transcript's KV (its previous prompt minus
  the instruction is a prefix of its next one), the system prompt computed once for all agents,
  the rest of each prompt computed. Token-granular: the best case of block-granular caching.
- per_request: prefix reuse, plus position-independent reuse of the round's outputs, recovered per
  agent with the policy (CacheBlend / EPIC style): each output's stored KV comes from its author's
  context, is re-rotated to the agent's positions and partly recomputed there.
- collective (KMesh): prefix reuse, plus recovery/collective.py: each round's outputs held once
  as the round's master, by default the first agent's own exact KV of them (`master` "sibling");
  or ("common") recovered once in the agents' common context (system prompt and earlier rounds'
  masters; from the same stored KV, at `shared_ratio`, by default 1.0: computed in full); every
  other agent's mirror re-places them and the policy recomputes `agent_ratio` of its blocks.
With a quality target (`quality`), per_request and collective run at the knobs it resolves to on
this model, or as prefix where it is served exactly (kmesh/recovery/quality.py).

The outputs' stored KV is the by-product of generation: each output computed after its author's
full prompt (decode work, not counted as prefill). Headers and closing tokens around an output
were not in its author's context and are computed.

Accounting: computed_tokens = token-layers computed / layers, every round; prefill_seconds = wall
time of the strategy's prefill work (recovery, restore, selection included); kv_bytes_per_agent =
bytes stored per agent for the rounds' output regions in whole blocks (dense copies for full,
prefix and per_request; master plus mirrors divided by the agents for collective). A round's new
tokens: its prompts' distinct segments no earlier round held (workloads/allgather.py::new_tokens).
Quality, on every prompt of rounds >= 1 (round 0 holds no outputs; all compute it exactly): KL of
the next-token distribution at the first generated position, top-1 agreement, and the common
prefix of 32 greedy tokens decoded from each strategy's own KV.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kmesh.bench.allgather.closed_loop import Loops
from kmesh.bench.allgather.config import (
    STRATEGIES,
    SWEEP_POLICIES,
    SWEEP_RATIOS,
    SWEEP_VARIANTS,
    AllGatherBenchConfig,
)
from kmesh.bench.allgather.frontier import run_frontier
from kmesh.bench.allgather.inputs import RecoveryInputs, Transcript, region_segments
from kmesh.bench.allgather.summary import (
    StrategyRun,
    scaling_row,
    strategies_report,
    summary_of,
    sweep_row,
)
from kmesh.bench.quality import greedy_decode
from kmesh.bench.signals.recovery import prompt_signals
from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import DenseKV, Executor
from kmesh.kv.master_mirror import kv_digest
from kmesh.kv.mirror_restore import restore
from kmesh.recovery.collective import recover_round
from kmesh.recovery.common_master import CommonContext, master_in_common
from kmesh.recovery.recover import Recovered, RecoveryConfig, recover
from kmesh.workloads.allgather import AgentTurn, AllGatherConfig, group_rounds, new_tokens

COMPUTE_ALL = RecoveryConfig("full", 1.0)


class AllGatherBench:
    """The reference run (and the outputs' stored KV) once; then strategies and sweeps."""

    def __init__(
        self,
        executor: Executor,
        fingerprint: str,
        turns: Sequence[AgentTurn],
        cfg: AllGatherBenchConfig,
        progress: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.executor = executor
        self.fingerprint = fingerprint
        self.cfg = cfg
        self.progress = progress
        self.rounds = group_rounds(turns)
        self.agents = len(self.rounds[0])
        if any(len(r) != self.agents for r in self.rounds):  # (an empty round too)
            raise ValueError("every round of the trace must hold one turn per agent")
        self.inputs = RecoveryInputs(executor, fingerprint, self.agents, cfg.block_size)
        progress("full (reference)")
        self.reference = self.run_full()

    @property
    def config(self) -> ModelConfig:
        return self.executor.config

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t.prompt.token_ids) for turns in self.rounds for t in turns)

    def run(self, name: str) -> StrategyRun:
        self.progress(name)
        if name in ("per_request", "collective") and self.cfg.quality is not None:
            return self._run_target(name)
        runs = {"prefix": self.run_prefix, "per_request": self.run_per_request}
        runs["collective"] = self.run_collective
        if name == "full":
            return self.reference
        if name not in runs:
            raise ValueError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")
        return runs[name]()

    def _run_target(self, name: str) -> StrategyRun:
        """`name` at the knobs its quality target resolves to, or exactly (as prefix), as served."""
        cfg = self.cfg.resolved(name, self.fingerprint)
        if cfg is None:
            run = self.run_prefix()
            run.name, run.extra["quality_served"] = name, "exact"
            return run
        return self.run_at(name, cfg)

    def summary(self, run: StrategyRun) -> dict[str, Any]:
        return summary_of(run, self.reference)

    def report(self) -> dict[str, Any]:
        runs = {name: self.summary(self.run(name)) for name in STRATEGIES}
        return strategies_report(runs, self.config_dict())

    def sweep(self, policies: Sequence[str], ratios: Sequence[float]) -> list[dict[str, Any]]:
        """Quality and compute vs ratio, per policy: per_request's recompute ratio; collective's
        agent ratio (master as configured); collective_shared's shared ratio (the common-context
        master, no agent correction: the once-per-round recovery from the stored KV alone)."""
        rows = []
        base = self.cfg
        for policy in policies:
            for ratio in ratios:
                for label, strategy, knob, fixed in SWEEP_VARIANTS:
                    overrides: dict[str, Any] = {"policy": policy, knob: ratio, **fixed}
                    row = self.summary(self.run_at(strategy, replace(base, **overrides)))
                    rows.append(sweep_row(policy, ratio, label, row))
        return rows

    def run_at(self, name: str, cfg: AllGatherBenchConfig) -> StrategyRun:
        """Strategy `name` under `cfg` (the bench's own configuration is kept)."""
        base, self.cfg = self.cfg, cfg
        try:
            return self.run(name)
        finally:
            self.cfg = base

    def config_dict(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "agents": self.agents,
            "rounds": len(self.rounds),
            **cfg.recovery_fields(),
            "block_size": cfg.block_size,
            "greedy_tokens": cfg.greedy_tokens,
            "model": self.fingerprint,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens_per_round": new_tokens(self.rounds),
        }

    def _add_dense_outputs(self, run: StrategyRun, r: int) -> None:
        """Count round r's outputs (none in round 0), held densely, in the run's KV per agent."""
        if r > 0:
            run.kv_bytes_per_agent += self.inputs.dense_output_bytes(self.rounds[r][0], r)

    def run_full(self) -> StrategyRun:
        """The reference; also stores every output's KV computed after its author's prompt."""
        run = StrategyRun("full")
        for r, turns in enumerate(self.rounds):
            regions = [self.inputs.new_region(t.prompt.segments, None, 0) for t in turns]
            started = time.perf_counter()
            recovered = recover(self.executor, regions, COMPUTE_ALL)
            run.add(r, seconds=time.perf_counter() - started)
            self._finish_round(run, r, turns, [None] * len(turns), recovered)
            self.inputs.store_outputs(r, turns, recovered)
            self._add_dense_outputs(run, r)
        return run

    def run_prefix(self) -> StrategyRun:
        run = StrategyRun("prefix")
        transcripts = self._start(run)
        for r in range(len(self.rounds)):
            self._prefill_after_transcripts(run, r, transcripts)
            self._add_dense_outputs(run, r)
        return run

    def run_per_request(self) -> StrategyRun:
        run = StrategyRun("per_request")
        transcripts = self._start(run)
        for r, turns in enumerate(self.rounds):
            started = time.perf_counter()
            regions = [
                self.inputs.reuse_region(r, t, x) for t, x in zip(turns, transcripts, strict=True)
            ]
            recovered = recover(self.executor, regions, self.cfg.recovery(self.cfg.recompute_ratio))
            run.add(r, seconds=time.perf_counter() - started)
            self._add_dense_outputs(run, r)
            self._finish_round(run, r, turns, transcripts, recovered)
        return run

    def run_collective(self) -> StrategyRun:
        run = StrategyRun("collective")
        run.extra = {"kv_bytes_master": 0, "kv_bytes_mirror_per_agent": 0.0}
        identical = True
        transcripts = self._start(run)
        # The "common" choice's context: the system prompt, then every earlier round's master.
        common = CommonContext(transcripts[0].k, transcripts[0].v)
        self._prefill_after_transcripts(run, 0, transcripts)  # no outputs yet
        for r, turns in enumerate(self.rounds[1:], start=1):
            started = time.perf_counter()
            master = None
            if self.cfg.master == "common":
                outputs = [self.inputs.output_reuse(r - 1, a, turns[0]) for a in range(self.agents)]
                shared_cfg = self.cfg.recovery(self.cfg.shared_ratio)
                master, shared = master_in_common(
                    self.executor, common, outputs, shared_cfg, self.cfg.block_size
                )
                common.extend(shared)
                # Shared work is counted once; _finish_round adds the siblings'.
                run.add(r, computed=shared.computed_tokens)
                run.fallbacks += int(shared.fell_back)
            siblings = [
                self.inputs.sibling(r, t, x) for t, x in zip(turns, transcripts, strict=True)
            ]
            result = recover_round(
                self.executor,
                siblings,
                self.cfg.recovery(self.cfg.agent_ratio),
                self.cfg.block_size,
                master,
            )
            run.add(r, seconds=time.perf_counter() - started)
            mirror_bytes = sum(s.mirror_bytes for s in result.siblings)
            run.kv_bytes_per_agent += (result.master.nbytes + mirror_bytes) / self.agents
            run.extra["kv_bytes_master"] += result.master.nbytes
            run.extra["kv_bytes_mirror_per_agent"] += mirror_bytes / self.agents
            for sibling, out in zip(siblings, result.siblings, strict=True):
                for mirror in out.mirrors:
                    k, v = restore(result.master, mirror, self.executor.config)
                    rows = mirror.positions - sibling.start
                    identical &= kv_digest(k, v) == kv_digest(
                        out.recovered.k[:, rows], out.recovered.v[:, rows]
                    )
            self._finish_round(run, r, turns, transcripts, [s.recovered for s in result.siblings])
        run.extra["restore_bit_identical"] = identical
        return run

    def _prefill_after_transcripts(
        self, run: StrategyRun, r: int, transcripts: list[Transcript]
    ) -> None:
        """Round r computed in full after each agent's transcript (exact prefix reuse only)."""
        turns = self.rounds[r]
        regions = [
            self.inputs.new_region(region_segments(t, x), x, len(x.token_ids))
            for t, x in zip(turns, transcripts, strict=True)
        ]
        started = time.perf_counter()
        recovered = recover(self.executor, regions, COMPUTE_ALL)
        run.add(r, seconds=time.perf_counter() - started)
        self._finish_round(run, r, turns, transcripts, recovered)

    def _start(self, run: StrategyRun) -> list[Transcript]:
        """Every agent's transcript starts with the shared system prompt, computed once."""
        system = self.rounds[0][0].prompt.segments[0]
        started = time.perf_counter()
        out = recover(self.executor, [self.inputs.new_region([system], None, 0)], COMPUTE_ALL)[0]
        run.add(0, out.computed_tokens, time.perf_counter() - started)
        return [Transcript(system.token_ids, out.k, out.v) for _ in range(self.agents)]

    def _finish_round(
        self,
        run: StrategyRun,
        r: int,
        turns: Sequence[AgentTurn],
        transcripts: Sequence[Transcript | None],
        recovered: Sequence[Recovered],
    ) -> None:
        """Count, take logits, decode greedily, and extend each transcript (not the instruction)."""
        contexts = []
        logits = []
        for a, (turn, transcript, rec) in enumerate(
            zip(turns, transcripts, recovered, strict=True)
        ):
            run.add(r, computed=rec.computed_tokens)
            run.fallbacks += int(rec.fell_back)
            if rec.deviation is not None:
                run.deviations[(r, a)] = rec.deviation
            if rec.last_hidden is None:
                raise AssertionError("the prompt's last token must be computed")
            logits.append(self.executor.logits(rec.last_hidden[None])[0])
            run.logits[(r, a)] = logits[-1]
            k, v, reused = (
                (rec.k, rec.v, rec.reused) if transcript is None else transcript.extend(turn, rec)
            )
            if r > 0:
                run.probes[(r, a)] = prompt_signals(self.executor, turn, (k, v), reused, logits[-1])
            contexts.append(DenseKV(torch.arange(k.shape[1]), list(k), list(v)))
        if r > 0:
            greedy = greedy_decode(
                self.executor, contexts, torch.stack(logits), self.cfg.greedy_tokens
            )
            for a, tokens in enumerate(greedy):
                run.greedy[(r, a)] = tokens


def run_allgather_bench(
    executor: Executor,
    fingerprint: str,
    turns: Sequence[AgentTurn],
    cfg: AllGatherBenchConfig,
    workload: AllGatherConfig,
    sweep: bool = False,
    scale: Sequence[Sequence[AgentTurn]] = (),
    progress: Callable[[str], None] = lambda _: None,
    frontier: Callable[[Loops], dict[str, dict[str, list[float]]]] | None = None,
) -> dict[str, Any]:
    """The report for `turns` (generated with `workload`); with `sweep`, quality vs recompute
    ratio per policy; with `scale`, the same strategies on traces with other agent counts; with
    `frontier` (it runs closed loops), the frontier sweep (bench/allgather/frontier.py)."""
    cfg = cfg.for_model(executor.config)
    bench = AllGatherBench(executor, fingerprint, turns, cfg, progress)
    report = bench.report()
    report["config"].update(
        order=workload.order, seed=workload.seed, output_tokens=workload.output_tokens
    )
    if sweep:
        report["sweep"] = bench.sweep(SWEEP_POLICIES, SWEEP_RATIOS)
    if frontier is not None:
        report["frontier"] = run_frontier(
            cfg, lambda _, name, point: bench.summary(bench.run_at(name, point)), frontier, progress
        )
    rows = []
    for other in scale:
        progress(f"scaling: {len({t.agent for t in other})} agents")
        if {t.agent for t in other} == {t.agent for t in turns}:
            rows.append(scaling_row(report))
            continue
        other_bench = AllGatherBench(executor, fingerprint, other, cfg, progress)
        rows.append(scaling_row(other_bench.report()))
    if rows:
        report["scaling"] = sorted(rows, key=lambda row: row["agents"])
    return report
