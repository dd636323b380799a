"""Recovery inside vLLM's worker: fill a request's claimed rows with recovered KV.

The scheduler half claims a request's full blocks after vLLM's local prefix hit ([start, end));
here they are filled before vLLM's forward pass, which then computes the rest of the prompt
against them. The exact prefix [0, start) is read back from vLLM's own pages (kmesh/vllm/pages.py);
the region [start, end) goes through kmesh.recovery:

- per request (no round): each shared segment in the region whose KV is stored (keyed by tenant
  and tokens) is re-rotated to its positions and reused; the policy recomputes `ratio` of it
  (kv_deviation, first_k, random; none keeps it as is, full recomputes all). Tokens no stored
  segment covers are computed. A shared segment this request computed in full is stored (its KV
  in this request's context, keys turned to canonical positions): later readers reuse it. One that
  crosses into the block vLLM computes is computed whole here for that (its tail twice).
- collective (a declared round): the round's output segments are recovered once, after the
  family's common context (its leading shared segments, then every earlier round's master), at
  the round's shared_ratio (1.0: computed in full), and kept as the round's dense master
  (kv/master_mirror.py). Each sibling places the master's segments at its own positions in its
  own order (mirrors: one gather + one RoPE call per contiguous run), the policy recomputes
  `ratio` of them, and its other tokens are computed. Siblings of a round in one step are
  recovered in one batch.

The gate: a region whose mean check-layer key deviation exceeds `gate` is not written; its blocks
are reported as load errors and vLLM's ordinary prefill recomputes them (the safe fallback).

What the worker keeps (stored segments, masters, common contexts) is bounded by `max_bytes`, least
recently used dropped first: a dropped segment is computed again by its next reader, a dropped
master rebuilt by the round's next sibling, a dropped common context restarted from the family's
leading shared segments.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.index.segment_index import SegmentIndex
from kmesh.kv.master_mirror import Master, Mirror, restore
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.recover import Recovered, RecoveryConfig, RegionInput, recover
from kmesh.state.keys import KeyNamespace
from kmesh.vllm.metadata import RecoverTokens, RecoveryReport, SegmentSpan
from kmesh.vllm.pages import Pages

# Contexts under which segment KV is filed in the index.
FIRST_READER = "first-reader"
# Block granularity of a round's master (the store's unit; independent of vLLM's pages).
MASTER_BLOCK = 16
# What the worker keeps for recovery, at most (kv_connector_extra_config "recovery_bytes").
DEFAULT_RECOVERY_BYTES = 1 << 30

_Key = tuple[str | None, str, str]  # (tenant, family, round id)


class _Ledger:
    """Sizes of what is kept, least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self._sizes: OrderedDict[tuple[Any, ...], int] = OrderedDict()

    def hold(self, key: tuple[Any, ...], nbytes: int) -> list[tuple[Any, ...]]:
        """Record `key` (most recent) at `nbytes`; the keys to drop to stay within the bound."""
        self.total += nbytes - self._sizes.pop(key, 0)
        self._sizes[key] = nbytes
        dropped = []
        while self.total > self.max_bytes and len(self._sizes) > 1:
            old, size = self._sizes.popitem(last=False)
            self.total -= size
            dropped.append(old)
        return dropped

    def touch(self, key: tuple[Any, ...]) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)


@dataclass(slots=True)
class _Common:
    """A family's common context: its leading shared segments, then every round's master."""

    k: torch.Tensor  # [layers, n, kv_heads, head_dim], positions 0..n-1
    v: torch.Tensor

    def dense(self) -> DenseKV:
        return DenseKV(torch.arange(self.k.shape[1]), list(self.k), list(self.v))


@dataclass(frozen=True, slots=True)
class Outcome:
    report: RecoveryReport
    # Rows [start, end) to write, None when the gate left them to vLLM.
    k: torch.Tensor | None
    v: torch.Tensor | None


class WorkerRecovery:
    """Holds the executor, the stored segment KV and the rounds' masters of one vLLM worker."""

    def __init__(
        self, executor: Executor, fingerprint: str, max_bytes: int = DEFAULT_RECOVERY_BYTES
    ) -> None:
        self.executor = executor
        self.fingerprint = fingerprint
        self.ledger = _Ledger(max_bytes)
        self._segments: dict[str | None, SegmentIndex[SegmentKV]] = {}
        self._commons: dict[tuple[str | None, str], _Common] = {}
        self._masters: dict[_Key, Master] = {}

    def run(self, jobs: Sequence[RecoverTokens], pages: Pages) -> dict[str, Outcome]:
        """Recover one step's jobs: per-request ones in order (each may store segments the next
        reuses), each round's siblings together."""
        outcomes: dict[str, Outcome] = {}
        rounds: dict[_Key, list[RecoverTokens]] = {}
        for job in jobs:
            round_ = job.spec.round
            if round_ is None or job.family is None:
                outcomes[job.request_id] = self._per_request(job, pages)
            else:
                rounds.setdefault((job.tenant, job.family, round_.id), []).append(job)
        for key, siblings in rounds.items():
            outcomes.update(self._round(key, siblings, pages))
        return outcomes

    # -- per request -----------------------------------------------------------------------

    def _per_request(self, job: RecoverTokens, pages: Pages) -> Outcome:
        end = self._storing_end(job)
        region = self._region(job, pages, self._stored_segments(job), end)
        recovered = recover(self.executor, [region], self._config(job))[0]
        if not recovered.fell_back:
            self._store_computed(job, region, recovered, end)
        outcome = _outcome(recovered, region, 0.0, 0)
        if outcome.k is None or outcome.v is None:
            return outcome
        rows = job.end - job.start  # the claimed rows; the rest was computed to be stored
        return Outcome(outcome.report, outcome.k[:, :rows], outcome.v[:, :rows])

    def _storing_end(self, job: RecoverTokens) -> int:
        """Where the region ends: the claimed rows, extended to the end of a shared segment that
        crosses into the block vLLM computes and is stored nowhere yet (so that its first reader
        can store it whole; those extra tokens are computed twice, once here)."""
        index = self._index(job.tenant)
        end = job.end
        for span in job.spans:
            crosses = job.start <= span.start < job.end < span.end
            tokens = job.token_ids[span.start : span.end]
            if span.role == "shared" and crosses and index.get(tokens, FIRST_READER) is None:
                end = max(end, span.end)
        return end

    def _stored_segments(self, job: RecoverTokens) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Span index -> (k, v) placed at the span's positions, for stored shared segments."""
        index = self._index(job.tenant)
        placed = {}
        for i, span in enumerate(job.spans):
            if span.role != "shared" or span.end <= job.start or span.start >= job.end:
                continue
            tokens = job.token_ids[span.start : span.end]
            stored = index.get(tokens, FIRST_READER)
            if stored is not None:
                self.ledger.touch(("segment", job.tenant, tuple(tokens)))
                positions = torch.arange(span.start, span.end)
                placed[i] = stored.placed(positions, self.executor.config)
        return placed

    def _store_computed(
        self, job: RecoverTokens, region: RegionInput, out: Recovered, end: int
    ) -> None:
        index = self._index(job.tenant)
        for span in job.spans:
            if span.role != "shared" or span.start < job.start or span.end > end:
                continue
            rows = slice(span.start - job.start, span.end - job.start)
            tokens = job.token_ids[span.start : span.end]
            if bool(region.reusable[rows].any()) or index.get(tokens, FIRST_READER) is not None:
                continue
            positions = torch.arange(span.start, span.end)
            stored = SegmentKV.canonical(
                out.k[:, rows], out.v[:, rows], positions, self.executor.config
            )
            index.put(tokens, FIRST_READER, 0, stored)
            self._hold(("segment", job.tenant, tuple(tokens)), stored.k.nbytes + stored.v.nbytes)

    # -- collective ------------------------------------------------------------------------

    def _round(self, key: _Key, jobs: list[RecoverTokens], pages: Pages) -> dict[str, Outcome]:
        built = key not in self._masters
        master, shared_cost = self._master_of(key, jobs[0])
        regions = [self._region(job, pages, self._mirrored(master, job)) for job in jobs]
        recovered = recover(self.executor, regions, self._config(jobs[0]))
        outcomes = {}
        for i, (job, region, out) in enumerate(zip(jobs, regions, recovered, strict=True)):
            first = built and i == 0
            outcomes[job.request_id] = _outcome(
                out, region, shared_cost if first else 0.0, master.nbytes if first else 0
            )
        return outcomes

    def _master_of(
        self, key: tuple[str | None, str, str], job: RecoverTokens
    ) -> tuple[Master, float]:
        """The round's master (built by its first sibling: the cost is returned once)."""
        master = self._masters.get(key)
        if master is not None:
            self.ledger.touch(("master", key))
            return master, 0.0
        tenant, family, _ = key
        assert job.spec.round is not None
        common, cost = self._common_of(tenant, family, job)
        spans = _round_spans(job)
        tokens = [job.token_ids[s.start : s.end] for s in spans]
        lengths = [len(t) for t in tokens]
        start = common.k.shape[1]
        positions = torch.arange(start, start + sum(lengths))
        index = self._index(tenant)
        ks, vs, reusable = [], [], []
        for segment_tokens, segment_positions in zip(tokens, positions.split(lengths), strict=True):
            stored = index.get(segment_tokens, FIRST_READER)
            if stored is None:
                blank = self._blank(len(segment_tokens))
                ks.append(blank)
                vs.append(blank)
                reusable.append(torch.zeros(len(segment_tokens), dtype=torch.bool))
            else:
                k, v = stored.placed(segment_positions, self.executor.config)
                ks.append(k)
                vs.append(v)
                reusable.append(torch.ones(len(segment_tokens), dtype=torch.bool))
        ratio = job.spec.round.shared_ratio
        policy = "full" if ratio >= 1.0 else job.spec.policy
        shared = recover(
            self.executor,
            [
                RegionInput(
                    torch.tensor([t for segment in tokens for t in segment]),
                    positions,
                    common.dense(),
                    torch.cat(ks, dim=1),
                    torch.cat(vs, dim=1),
                    torch.cat(reusable),
                    torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
                )
            ],
            RecoveryConfig(policy, ratio, job.spec.check_layer, job.spec.gate),
        )[0]
        master = Master.build(
            list(
                zip(
                    shared.k.split(lengths, dim=1),
                    shared.v.split(lengths, dim=1),
                    positions.split(lengths),
                    strict=True,
                )
            ),
            MASTER_BLOCK,
            self.executor.config,
        )
        common.k = torch.cat((common.k, shared.k), dim=1)
        common.v = torch.cat((common.v, shared.v), dim=1)
        self._masters[key] = master
        self._hold(("common", tenant, family), common.k.nbytes + common.v.nbytes)
        self._hold(("master", key), master.nbytes)
        return master, cost + shared.computed_tokens

    def _common_of(
        self, tenant: str | None, family: str, job: RecoverTokens
    ) -> tuple[_Common, float]:
        """The family's common context; its leading shared segments are computed on first use."""
        common = self._commons.get((tenant, family))
        if common is not None:
            self.ledger.touch(("common", tenant, family))
            return common, 0.0
        round_ids = set(job.spec.round.segments) if job.spec.round is not None else set()
        trunk = 0
        for span in job.spans:
            if span.role != "shared" or span.segment_id in round_ids:
                break
            trunk = span.end
        config = self.executor.config
        if trunk == 0:
            empty = torch.zeros((config.num_layers, 0, config.num_kv_heads, config.head_dim))
            common = _Common(empty.to(self.executor.dtype), empty.to(self.executor.dtype))
        else:
            out = self.executor.forward(
                [SequenceInput(torch.tensor(job.token_ids[:trunk]), torch.arange(trunk))]
            )[0]
            common = _Common(torch.stack(out.k), torch.stack(out.v))
        self._commons[(tenant, family)] = common
        return common, float(trunk)

    def _mirrored(
        self, master: Master, job: RecoverTokens
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Span index -> the master's KV of that round segment at the span's positions, one
        mirror (fused gather + RoPE) per contiguous run of round segments."""
        assert job.spec.round is not None
        canonical = {sid: i for i, sid in enumerate(job.spec.round.segments)}
        runs: list[list[int]] = []
        for i, span in enumerate(job.spans):
            if span.segment_id not in canonical:
                continue
            if runs and job.spans[runs[-1][-1]].end == span.start:
                runs[-1].append(i)
            else:
                runs.append([i])
        placed = {}
        for run in runs:
            order = [canonical[job.spans[i].segment_id or ""] for i in run]
            k, v = restore(
                master, Mirror.of(master, order, job.spans[run[0]].start), self.executor.config
            )
            offset = 0
            for i in run:
                n = job.spans[i].end - job.spans[i].start
                placed[i] = (k[:, offset : offset + n], v[:, offset : offset + n])
                offset += n
        return placed

    # -- shared pieces ---------------------------------------------------------------------

    def _region(
        self,
        job: RecoverTokens,
        pages: Pages,
        reused: dict[int, tuple[torch.Tensor, torch.Tensor]],
        end: int | None = None,
    ) -> RegionInput:
        """The claimed rows (to `end`, by default the claim's) as a region: reused rows where
        `reused` covers them, the exact prefix read back from vLLM's pages."""
        end = job.end if end is None else end
        t = end - job.start
        k = self._blank(t)
        v = self._blank(t)
        reusable = torch.zeros(t, dtype=torch.bool)
        segment = torch.zeros(t, dtype=torch.int64)
        for i, span in enumerate(job.spans):
            lo, hi = max(span.start, job.start), min(span.end, end)
            if lo >= hi:
                continue
            segment[lo - job.start : hi - job.start] = i
            if i in reused:
                span_k, span_v = reused[i]
                k[:, lo - job.start : hi - job.start] = span_k[:, lo - span.start : hi - span.start]
                v[:, lo - job.start : hi - job.start] = span_v[:, lo - span.start : hi - span.start]
                reusable[lo - job.start : hi - job.start] = True
        prefix = None
        if job.start > 0:
            positions = torch.arange(job.start)
            prefix_k, prefix_v = pages.read(job.block_ids, positions)
            prefix = DenseKV(positions, list(prefix_k), list(prefix_v))
        return RegionInput(
            torch.tensor(job.token_ids[job.start : end]),
            torch.arange(job.start, end),
            prefix,
            k,
            v,
            reusable,
            segment,
        )

    def _config(self, job: RecoverTokens) -> RecoveryConfig:
        spec = job.spec
        return RecoveryConfig(
            spec.policy, spec.ratio, spec.check_layer, spec.gate, recompute_on_gate=False
        )

    def _hold(self, key: tuple[Any, ...], nbytes: int) -> None:
        """Keep `key`'s state within the ledger's bound, dropping the least recently used."""
        for dropped in self.ledger.hold(key, nbytes):
            if dropped[0] == "segment":  # ("segment", tenant, tokens)
                self._index(dropped[1]).discard(dropped[2], FIRST_READER)
            elif dropped[0] == "master":  # ("master", (tenant, family, round id))
                self._masters.pop(dropped[1], None)
            else:  # ("common", tenant, family)
                self._commons.pop((dropped[1], dropped[2]), None)

    def _index(self, tenant: str | None) -> SegmentIndex[SegmentKV]:
        index = self._segments.get(tenant)
        if index is None:
            index = SegmentIndex(KeyNamespace(self.fingerprint, None, tenant))
            self._segments[tenant] = index
        return index

    def _blank(self, n: int) -> torch.Tensor:
        c = self.executor.config
        return torch.zeros((c.num_layers, n, c.num_kv_heads, c.head_dim), dtype=self.executor.dtype)


def _round_spans(job: RecoverTokens) -> list[SegmentSpan]:
    """The round's output segments of `job`, in the round's canonical order."""
    assert job.spec.round is not None
    by_id = {span.segment_id: span for span in job.spans}
    return [by_id[sid] for sid in job.spec.round.segments]


def _outcome(
    recovered: Recovered, region: RegionInput, shared: float, master_bytes: int
) -> Outcome:
    report = RecoveryReport(
        computed_tokens=recovered.computed_tokens,
        shared_computed_tokens=shared,
        master_bytes=master_bytes,
        reused_tokens=int(region.reusable.sum()) - len(recovered.recomputed),
        deviation=recovered.deviation,
        fell_back=recovered.fell_back,
    )
    if recovered.fell_back:
        return Outcome(report, None, None)
    return Outcome(report, recovered.k, recovered.v)
