"""`kmesh bench allgather`: one All-Gather trace, four ways to prefill it, measured against full.

Strategies, all replaying the same prompts (a trace from workloads/allgather.py):
- full: every prompt computed from scratch; the reference for quality.
- prefix: exact prefix reuse: each agent keeps its own transcript's KV (its previous prompt
  minus the instruction is a prefix of its next one) and the system prompt is computed once for
  all agents; the rest of each prompt is computed. Token-granular: the best case of block-granular
  caching.
- per_request: prefix reuse, plus position-independent reuse of the round's outputs, recovered per
  agent with the policy (CacheBlend / EPIC style): each output's stored KV comes from its author's
  context, is re-rotated to the agent's positions and partly recomputed there.
- collective (KMesh): prefix reuse, plus recovery/collective.py: each round's outputs held once
  as the round's master, by default the first agent's own exact KV of them (`master` "sibling");
  or ("common") recovered once in the agents' common context (system prompt and earlier rounds'
  masters; from the same stored KV, at `shared_ratio`, by default 1.0: computed in full); every
  other agent's mirror re-places them and the policy recomputes `agent_ratio` of its blocks.

The outputs' stored KV is the by-product of generation: each output computed after its author's
full prompt (the reference run gives it; it is decode work, not counted as prefill). Headers and
closing tokens around an output were not in its author's context and are computed.

Accounting: computed_tokens = token-layers computed / layers (a token computed through 2 of 30
layers counts 2/30), every round; prefill_seconds = wall time of the strategy's prefill work
(recovery, restore, selection included); kv_bytes_per_agent = bytes stored per agent for the
rounds' output regions in whole blocks (dense copies for full, prefix and per_request; master plus
mirrors divided by the agents for collective). A round's new tokens are those of the distinct
segments of its prompts that no earlier round's prompt held (workloads/allgather.py::new_tokens).
Quality is measured on every prompt that holds outputs (rounds >= 1; round-0 prompts hold none and
every strategy computes them exactly): KL of the next-token distribution at the first generated
position, top-1 agreement and the common prefix of 32 greedy tokens decoded from each strategy's
own KV.
"""

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kmesh.bench.quality import Quality, greedy_decode
from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.errors import InvalidRequestError
from kmesh.index.segment_index import AUTHOR, SegmentIndex
from kmesh.kv.master_mirror import kv_digest, restore
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.collective import (
    MASTER_CHOICES,
    CommonContext,
    SharedSegment,
    SiblingInput,
    master_in_common,
    recover_round,
)
from kmesh.recovery.policies import POLICIES
from kmesh.recovery.recover import Recovered, RecoveryConfig, RegionInput, recover
from kmesh.state.keys import KeyNamespace
from kmesh.state.segments import Segment
from kmesh.workloads.allgather import (
    AgentTurn,
    AllGatherConfig,
    group_rounds,
    new_tokens,
    output_segment_id,
)

STRATEGIES = ("full", "prefix", "per_request", "collective")
COMPUTE_ALL = RecoveryConfig("full", 1.0)


@dataclass(frozen=True, slots=True)
class AllGatherBenchConfig:
    policy: str = "kv_deviation"
    # collective: where each round's master comes from (recovery/collective.py).
    master: str = "sibling"
    # per_request: share of each agent's reused tokens recomputed in its own context.
    recompute_ratio: float = 0.3
    # collective: share of the round's outputs recomputed once in the common context (1.0: all
    # of them, the shared step is then a plain prefill of the outputs after the shared context) ...
    shared_ratio: float = 1.0
    # ... and share of each agent's reused blocks recomputed in its own context.
    agent_ratio: float = 0.0
    check_layer: int = 1
    # Quality gate: a region whose mean relative key deviation at the check layer exceeds this is
    # recomputed in full. Normal reuse on the embedded model deviates 0.006-0.022; garbage ~1.
    gate: float | None = 0.1
    # Share of a region's reused tokens the gate checks when no policy scores them all (recover.py).
    gate_sample: float = 0.125
    block_size: int = 16
    greedy_tokens: int = 32

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if self.master not in MASTER_CHOICES:
            raise InvalidRequestError(
                f"--master must be one of {MASTER_CHOICES}, got {self.master!r}"
            )
        for flag, value in (
            ("--recompute-ratio", self.recompute_ratio),
            ("--shared-ratio", self.shared_ratio),
            ("--agent-ratio", self.agent_ratio),
        ):
            if not 0.0 <= value <= 1.0:
                raise InvalidRequestError(f"{flag} must be between 0 and 1, got {value}")
        if self.check_layer < 1:
            raise InvalidRequestError(
                "--check-layer must be at least 1 (layer 0 keys depend on token and position only)"
            )
        if self.gate is not None and self.gate < 0:
            raise InvalidRequestError(f"--gate must be >= 0, got {self.gate}")
        if not 0.0 < self.gate_sample <= 1.0:
            raise InvalidRequestError(
                f"--gate-sample must be above 0 and at most 1, got {self.gate_sample}"
            )
        if self.block_size < 1 or self.greedy_tokens < 1:
            raise InvalidRequestError("block size and greedy tokens must be at least 1")

    def recovery(self, ratio: float) -> RecoveryConfig:
        policy = "full" if ratio >= 1.0 else self.policy
        return RecoveryConfig(
            policy, ratio, self.check_layer, self.gate, gate_sample=self.gate_sample
        )


@dataclass(slots=True)
class StrategyRun:
    name: str
    # Per round: computed tokens (token-layers / layers) and prefill seconds.
    computed: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    kv_bytes_per_agent: float = 0.0
    fallbacks: int = 0
    # Each recovered region's mean relative key deviation at the check layer (the gate's signal).
    deviations: list[float] = field(default_factory=list)
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    greedy: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, r: int, computed: float = 0.0, seconds: float = 0.0) -> None:
        while len(self.computed) <= r:
            self.computed.append(0.0)
            self.seconds.append(0.0)
        self.computed[r] += computed
        self.seconds[r] += seconds

    @property
    def computed_tokens(self) -> float:
        return sum(self.computed)

    @property
    def prefill_seconds(self) -> float:
        return sum(self.seconds)


@dataclass(slots=True)
class _Transcript:
    """An agent's exact context so far (its prompt minus the instruction) and that KV."""

    token_ids: tuple[int, ...]
    k: torch.Tensor  # [layers, p, kv_heads, head_dim]
    v: torch.Tensor

    def context(self) -> DenseKV:
        return DenseKV(torch.arange(len(self.token_ids)), list(self.k), list(self.v))


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
        self.index: SegmentIndex[SegmentKV] = SegmentIndex(KeyNamespace(fingerprint))
        model = executor.config
        element = torch.empty((), dtype=executor.dtype).element_size()
        self.block_bytes = (
            2 * model.num_layers * cfg.block_size * model.num_kv_heads * model.head_dim * element
        )
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
        if name == "full":
            return self.reference
        if name == "prefix":
            return self.run_prefix()
        if name == "per_request":
            return self.run_per_request()
        if name == "collective":
            return self.run_collective()
        raise ValueError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")

    def summary(self, run: StrategyRun) -> dict[str, Any]:
        return summary_of(run, self.reference)

    def report(self) -> dict[str, Any]:
        runs = {name: self.summary(self.run(name)) for name in STRATEGIES}
        return strategies_report(runs, self.config_dict())

    def sweep(self, policies: Sequence[str], ratios: Sequence[float]) -> list[dict[str, Any]]:
        """Quality and compute vs ratio, per policy: per_request's recompute ratio; collective's
        agent ratio (master as configured); collective_shared's shared ratio (the common-context
        master, no agent correction: the once-per-round recovery from the stored KV alone)."""
        variants: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
            ("per_request", "per_request", "recompute_ratio", {}),
            ("collective", "collective", "agent_ratio", {}),
            (
                "collective_shared",
                "collective",
                "shared_ratio",
                {"agent_ratio": 0.0, "master": "common"},
            ),
        )
        rows = []
        base = self.cfg
        for policy in policies:
            for ratio in ratios:
                for label, strategy, knob, fixed in variants:
                    overrides: dict[str, Any] = {"policy": policy, knob: ratio, **fixed}
                    self.cfg = replace(base, **overrides)
                    row = self.summary(self.run(strategy))
                    rows.append(
                        {
                            "policy": policy,
                            "ratio": ratio,
                            "strategy": label,
                            "computed_tokens": row["computed_tokens"],
                            "prefill_seconds": row["prefill_seconds"],
                            "quality": row["quality"],
                        }
                    )
        self.cfg = base
        return rows

    def config_dict(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "agents": self.agents,
            "rounds": len(self.rounds),
            "policy": cfg.policy,
            "master": cfg.master,
            "recompute_ratio": cfg.recompute_ratio,
            "shared_ratio": cfg.shared_ratio,
            "agent_ratio": cfg.agent_ratio,
            "check_layer": cfg.check_layer,
            "gate": cfg.gate,
            "gate_sample": cfg.gate_sample,
            "block_size": cfg.block_size,
            "greedy_tokens": cfg.greedy_tokens,
            "model": self.fingerprint,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens_per_round": new_tokens(self.rounds),
        }

    # --- the four strategies -------------------------------------------------------------------

    def run_full(self) -> StrategyRun:
        """The reference; also stores every output's KV computed after its author's prompt."""
        run = StrategyRun("full")
        for r, turns in enumerate(self.rounds):
            regions = [self._new_region(t.prompt.segments, None, 0) for t in turns]
            started = time.perf_counter()
            recovered = recover(self.executor, regions, COMPUTE_ALL)
            run.add(r, seconds=time.perf_counter() - started)
            self._finish_round(run, r, turns, [None] * len(turns), recovered)
            self._store_outputs(r, turns, recovered)
            if r > 0:
                run.kv_bytes_per_agent += self._dense_output_bytes(r)
        return run

    def run_prefix(self) -> StrategyRun:
        run = StrategyRun("prefix")
        transcripts = self._start(run)
        for r in range(len(self.rounds)):
            self._prefill_after_transcripts(run, r, transcripts)
            if r > 0:
                run.kv_bytes_per_agent += self._dense_output_bytes(r)
        return run

    def run_per_request(self) -> StrategyRun:
        run = StrategyRun("per_request")
        transcripts = self._start(run)
        for r, turns in enumerate(self.rounds):
            started = time.perf_counter()
            regions = [self._reuse_region(r, t, x) for t, x in zip(turns, transcripts, strict=True)]
            recovered = recover(self.executor, regions, self.cfg.recovery(self.cfg.recompute_ratio))
            run.add(r, seconds=time.perf_counter() - started)
            if r > 0:
                run.kv_bytes_per_agent += self._dense_output_bytes(r)
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
                outputs = [self._output_reuse(r - 1, a, turns[0]) for a in range(self.agents)]
                shared_cfg = self.cfg.recovery(self.cfg.shared_ratio)
                master, shared = master_in_common(
                    self.executor, common, outputs, shared_cfg, self.cfg.block_size
                )
                common.extend(shared)
                # Shared work is counted once; _finish_round adds the siblings'.
                run.add(r, computed=shared.computed_tokens)
                run.fallbacks += int(shared.fell_back)
            siblings = [self._sibling(r, t, x) for t, x in zip(turns, transcripts, strict=True)]
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

    # --- pieces ---------------------------------------------------------------------------------

    def _prefill_after_transcripts(
        self, run: StrategyRun, r: int, transcripts: list[_Transcript]
    ) -> None:
        """Round r computed in full after each agent's transcript (exact prefix reuse only)."""
        turns = self.rounds[r]
        regions = [
            self._new_region(self._region_segments(t, x), x, len(x.token_ids))
            for t, x in zip(turns, transcripts, strict=True)
        ]
        started = time.perf_counter()
        recovered = recover(self.executor, regions, COMPUTE_ALL)
        run.add(r, seconds=time.perf_counter() - started)
        self._finish_round(run, r, turns, transcripts, recovered)

    def _start(self, run: StrategyRun) -> list[_Transcript]:
        """Every agent's transcript starts with the shared system prompt, computed once."""
        system = self.rounds[0][0].prompt.segments[0]
        started = time.perf_counter()
        out = recover(self.executor, [self._new_region([system], None, 0)], COMPUTE_ALL)[0]
        run.add(0, out.computed_tokens, time.perf_counter() - started)
        return [_Transcript(system.token_ids, out.k, out.v) for _ in range(self.agents)]

    def _region_segments(self, turn: AgentTurn, transcript: _Transcript) -> list[Segment]:
        """The prompt's segments after the agent's transcript (its previous prompt minus ask)."""
        p = len(transcript.token_ids)
        if turn.prompt.token_ids[:p] != transcript.token_ids:
            raise ValueError(
                f"agent {turn.agent}'s round-{turn.round} prompt does not extend its transcript"
            )
        spans = turn.prompt.spans
        first = next(i for i, span in enumerate(spans) if span.start == p)
        return list(turn.prompt.segments[first:])

    def _new_region(
        self, segments: Sequence[Segment], transcript: _Transcript | None, start: int
    ) -> RegionInput:
        """A region with nothing reusable: computed in full."""
        tokens = torch.tensor([t for s in segments for t in s.token_ids])
        n = len(tokens)
        blank = self._blank(n)
        return RegionInput(
            tokens,
            torch.arange(start, start + n),
            None if transcript is None else transcript.context(),
            blank,
            blank,
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n, dtype=torch.int64),
        )

    def _reuse_region(self, r: int, turn: AgentTurn, transcript: _Transcript) -> RegionInput:
        """Per-request reuse: the round's outputs from their authors' KV, at the agent's offsets."""
        segments = self._region_segments(turn, transcript)
        start = len(transcript.token_ids)
        ks, vs, reusable, segment_of = [], [], [], []
        position = start
        for index, segment in enumerate(segments):
            n = len(segment.token_ids)
            author = self._author(r, segment)
            if author is None:
                k = v = self._blank(n)
                mask = torch.zeros(n, dtype=torch.bool)
            else:
                shared = self._output_reuse(r - 1, author, turn)
                k, v = shared.stored.placed(torch.arange(position, position + n), self.config)
                mask = shared.reusable
            ks.append(k)
            vs.append(v)
            reusable.append(mask)
            segment_of.append(torch.full((n,), index))
            position += n
        tokens = torch.tensor([t for s in segments for t in s.token_ids])
        return RegionInput(
            tokens,
            torch.arange(start, position),
            transcript.context(),
            torch.cat(ks, dim=1),
            torch.cat(vs, dim=1),
            torch.cat(reusable),
            torch.cat(segment_of),
        )

    def _author(self, r: int, segment: Segment) -> int | None:
        if r == 0:
            return None
        for author in range(self.agents):
            if segment.segment_id == output_segment_id(r - 1, author):
                return author
        return None

    def _output_reuse(self, r: int, author: int, reader: AgentTurn) -> SharedSegment:
        """Round r's output of `author` as read in `reader`'s prompt: its stored (author-context)
        KV on the generated tokens, nothing on the header and closing tokens (nor on an output
        too short for the index to find inside a segment: computed)."""
        wanted = output_segment_id(r, author)
        segment = next(s for s in reader.prompt.segments if s.segment_id == wanted)
        tokens = segment.token_ids
        n = len(tokens)
        k = self._blank(n)
        v = self._blank(n)
        found = self.index.find_within(tokens, AUTHOR)
        if found is None:
            return SharedSegment(
                torch.tensor(tokens), SegmentKV(k, v), torch.zeros(n, dtype=torch.bool)
            )
        offset, entry = found
        body, stored = entry.token_ids, entry.value
        body_k, body_v = stored.placed(torch.arange(offset, offset + len(body)), self.config)
        k[:, offset : offset + len(body)] = body_k
        v[:, offset : offset + len(body)] = body_v
        reusable = torch.zeros(n, dtype=torch.bool)
        reusable[offset : offset + len(body)] = True
        return SharedSegment(torch.tensor(tokens), SegmentKV(k, v), reusable)

    def _sibling(self, r: int, turn: AgentTurn, transcript: _Transcript) -> SiblingInput:
        """The agent's round-r prompt after its transcript, with where round r - 1's outputs lie
        (in author order: the round's canonical order)."""
        segments = self._region_segments(turn, transcript)
        where = {
            segment.segment_id: (span.start, span.end)
            for segment, span in zip(turn.prompt.segments, turn.prompt.spans, strict=True)
        }
        return SiblingInput(
            torch.tensor([t for s in segments for t in s.token_ids]),
            len(transcript.token_ids),
            transcript.context(),
            [where[output_segment_id(r - 1, a)] for a in range(self.agents)],
        )

    def _blank(self, n: int) -> torch.Tensor:
        c = self.config
        return torch.zeros((c.num_layers, n, c.num_kv_heads, c.head_dim), dtype=self.executor.dtype)

    def _dense_output_bytes(self, r: int) -> int:
        """A dense copy of round r's outputs in whole blocks (each output starts a block)."""
        reader = self.rounds[r][0]
        lengths = [
            len(s.token_ids) for s in reader.prompt.segments if self._author(r, s) is not None
        ][-self.agents :]
        bs = self.cfg.block_size
        return sum(-(-n // bs) for n in lengths) * self.block_bytes

    def _store_outputs(
        self, r: int, turns: Sequence[AgentTurn], recovered: list[Recovered]
    ) -> None:
        """Each output's KV computed after its author's prompt, as generation leaves it."""
        batch = []
        for turn, rec in zip(turns, recovered, strict=True):
            n = len(turn.prompt.token_ids)
            context = DenseKV(torch.arange(n), list(rec.k), list(rec.v))
            positions = torch.arange(n, n + len(turn.output_ids))
            batch.append(SequenceInput(torch.tensor(turn.output_ids), positions, context))
        for turn, item, out in zip(turns, batch, self.executor.forward(batch), strict=True):
            k, v = torch.stack(out.k), torch.stack(out.v)
            stored = SegmentKV.canonical(k, v, item.positions, self.config)
            self.index.put(turn.output_ids, AUTHOR, r, stored)

    def _finish_round(
        self,
        run: StrategyRun,
        r: int,
        turns: Sequence[AgentTurn],
        transcripts: Sequence[_Transcript | None],
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
                run.deviations.append(rec.deviation)
            if rec.last_hidden is None:
                raise AssertionError("the prompt's last token must be computed")
            logits.append(self.executor.logits(rec.last_hidden[None])[0])
            run.logits[(r, a)] = logits[-1]
            if transcript is None:
                k, v = rec.k, rec.v
            else:
                k = torch.cat((transcript.k, rec.k), dim=1)
                v = torch.cat((transcript.v, rec.v), dim=1)
                keep = len(turn.prompt.token_ids) - len(turn.prompt.segments[-1].token_ids)
                transcript.token_ids = turn.prompt.token_ids[:keep]
                transcript.k, transcript.v = k[:, :keep], v[:, :keep]
            contexts.append(DenseKV(torch.arange(k.shape[1]), list(k), list(v)))
        if r > 0:
            greedy = greedy_decode(
                self.executor, contexts, torch.stack(logits), self.cfg.greedy_tokens
            )
            for a, tokens in enumerate(greedy):
                run.greedy[(r, a)] = tokens


def hardware() -> str:
    return (
        f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU, torch {torch.__version__}, fp32"
    )


def summary_of(run: StrategyRun, reference: StrategyRun) -> dict[str, Any]:
    keys = sorted(run.greedy)
    quality = Quality.measure(
        torch.stack([reference.logits[k] for k in keys]),
        torch.stack([run.logits[k] for k in keys]),
        [reference.greedy[k] for k in keys],
        [run.greedy[k] for k in keys],
    )
    return {
        "computed_tokens": round(run.computed_tokens, 2),
        "prefill_seconds": round(run.prefill_seconds, 3),
        # Rounds >= 1, where the prompts hold the outputs: the work reuse can save.
        "computed_tokens_reuse_rounds": round(sum(run.computed[1:]), 2),
        "prefill_seconds_reuse_rounds": round(sum(run.seconds[1:]), 3),
        "per_round": [
            {"computed_tokens": round(c, 2), "prefill_seconds": round(t, 3)}
            for c, t in zip(run.computed, run.seconds, strict=True)
        ],
        "kv_bytes_per_agent": round(run.kv_bytes_per_agent),
        "fallbacks": run.fallbacks,
        "check_deviation_max": round(max(run.deviations), 4) if run.deviations else None,
        "quality": quality.as_dict(),
        **run.extra,
    }


def strategies_report(runs: dict[str, dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """The report of the four strategies' summaries (the JSON both engines' benches write)."""
    per_request, collective = runs["per_request"], runs["collective"]
    dense = runs["full"]["kv_bytes_per_agent"]
    new = config["new_tokens_per_round"][-1]
    return {
        "hardware": hardware(),
        "note": (
            "CPU figures are functional/trend results, not comparable to the papers' GPU numbers"
        ),
        "config": config,
        "strategies": runs,
        "comparison": {
            "computed_collective_over_per_request": _ratio(
                collective["computed_tokens"], per_request["computed_tokens"]
            ),
            "seconds_collective_over_per_request": _ratio(
                collective["prefill_seconds"], per_request["prefill_seconds"]
            ),
            "computed_collective_over_prefix": _ratio(
                collective["computed_tokens"], runs["prefix"]["computed_tokens"]
            ),
            # The last round's computed tokens over the tokens new to the system in it.
            "last_round_computed_over_new": {
                name: _ratio(run["per_round"][-1]["computed_tokens"], new)
                for name, run in runs.items()
            },
            "computed_collective_over_per_request_reuse_rounds": _ratio(
                collective["computed_tokens_reuse_rounds"],
                per_request["computed_tokens_reuse_rounds"],
            ),
            "seconds_collective_over_per_request_reuse_rounds": _ratio(
                collective["prefill_seconds_reuse_rounds"],
                per_request["prefill_seconds_reuse_rounds"],
            ),
            "kv_dense_over_collective": _ratio(dense, collective["kv_bytes_per_agent"]),
            "kv_dense_over_mirror": _ratio(dense, collective["kv_bytes_mirror_per_agent"]),
        },
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


SWEEP_POLICIES = ("kv_deviation", "first_k", "random", "none")
SWEEP_RATIOS = (0.0, 0.05, 0.15, 0.3)


def scaling_row(bench: AllGatherBench, report: dict[str, Any]) -> dict[str, Any]:
    """Compute, time and storage of one agent count (from its report)."""
    keys = ("computed_tokens", "prefill_seconds", "kv_bytes_per_agent")
    return {
        "agents": bench.agents,
        "strategies": {
            name: {key: row[key] for key in keys} for name, row in report["strategies"].items()
        },
        "kv_dense_over_collective": report["comparison"]["kv_dense_over_collective"],
        "kv_dense_over_mirror": report["comparison"]["kv_dense_over_mirror"],
    }


def run_allgather_bench(
    executor: Executor,
    fingerprint: str,
    turns: Sequence[AgentTurn],
    cfg: AllGatherBenchConfig,
    workload: AllGatherConfig,
    sweep: bool = False,
    scale: Sequence[Sequence[AgentTurn]] = (),
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The report for `turns` (generated with `workload`); with `sweep`, quality vs recompute
    ratio per policy; with `scale`, the same strategies on traces with other agent counts."""
    if cfg.check_layer >= executor.config.num_layers:
        raise InvalidRequestError(
            f"--check-layer must be below the model's {executor.config.num_layers} layers"
        )
    bench = AllGatherBench(executor, fingerprint, turns, cfg, progress)
    report = bench.report()
    report["config"].update(
        order=workload.order, seed=workload.seed, output_tokens=workload.output_tokens
    )
    if sweep:
        report["sweep"] = bench.sweep(SWEEP_POLICIES, SWEEP_RATIOS)
    rows = []
    for other in scale:
        progress(f"scaling: {len({t.agent for t in other})} agents")
        if {t.agent for t in other} == {t.agent for t in turns}:
            rows.append(scaling_row(bench, report))
            continue
        other_bench = AllGatherBench(executor, fingerprint, other, cfg, progress)
        rows.append(scaling_row(other_bench, other_bench.report()))
    if rows:
        report["scaling"] = sorted(rows, key=lambda row: row["agents"])
    return report
