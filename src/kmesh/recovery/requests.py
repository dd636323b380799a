"""Recovery of the requests that ask for it: fill a request's claimed rows with recovered KV.

Both engines hand their jobs (kmesh/recovery/jobs.py) here: each claims every prompt row after its
local prefix hit but the last ([start, end); vLLM's connector, whose worker half runs this before
vLLM's forward pass, claims whole pages only for policy full; the reference engine's runner). The
engine then computes the rest of the prompt against the filled rows. The exact prefix [0, start) is
read back from the engine's pages (a PrefixReader: kmesh/vllm/pages.py, kmesh/kv/kv_cache.py); the
region [start, end) goes through kmesh.recovery:

- per request (no round): each shared segment in the region whose KV is stored (keyed by tenant
  and tokens) is re-rotated to its positions and reused, or else the stored output of an earlier
  request (`keep_output`: its generated tokens' KV as its author computed them) found inside it,
  the segment's other tokens (a header, closing tokens) then computed; the policy recomputes `ratio`
  of the reused tokens (recovery/policies.py; none keeps it as is, full recomputes all).
  Tokens no stored segment covers are computed. A shared segment this request computed in full
  is stored (its KV in this request's context, keys turned to canonical positions): later readers
  reuse it. One that crosses past the claimed rows (into the prompt's last token) is computed
  whole here for that (its tail twice).
- collective (a declared round, kmesh/recovery/collective.py): the round's master is its first
  sibling's own exact KV of the round's output segments (or, with `master: "common"`, the outputs
  recovered once after the family's common context: its leading shared segments, then every
  earlier round's master), kept by this object. Each other sibling places the master's segments
  at its own positions in its own order (mirrors), the policy recomputes `ratio` of the placed
  blocks, and its other tokens are computed. Siblings of a round in one step are recovered in one
  batch.

The gate: a region whose mean check-layer key deviation exceeds `gate` is not written (k, v None);
the engine computes those rows itself (vLLM: load errors, recomputed by its prefill), the fallback.

What a RequestRecovery keeps (stored segments, masters, common contexts) is bounded by
`max_bytes`, least recently used dropped first: a dropped segment is computed again by its next
reader, a dropped master rebuilt by the round's next sibling, a dropped common context restarted
from the family's leading shared segments.

Shared (`share`, a SharedState: shared.py, implemented by the store), state goes beyond this
engine: rounds' masters (a round lacking its master looks there first), jobs' transcripts
(continuations.py: a job restores what an earlier job of any engine published, and publishes
its new rows), first readers' segments (segment_store.py).
"""

from collections.abc import Sequence

import torch

from kmesh.compute.executor import DenseKV, Executor
from kmesh.kv.master_mirror import Master
from kmesh.recovery.collective import MASTER_BLOCK, SiblingInput, blank_kv, recover_round
from kmesh.recovery.common_master import CommonMasters
from kmesh.recovery.continuations import Continuations
from kmesh.recovery.jobs import (
    PrefixReader,
    RecoveredRows,
    RecoveryJob,
    RecoveryReport,
    RoundKey,
    RoundMirrors,
    Writer,
)
from kmesh.recovery.ledger import Held, HeldMaster, HeldSegment, HeldTail, Ledger
from kmesh.recovery.prefix_tails import PrefixTails, TailPages
from kmesh.recovery.recover import Recovered, RecoveryConfig, RegionInput, recover
from kmesh.recovery.segment_store import Placed, SegmentStore
from kmesh.recovery.shared import Restored, SharedMasters, SharedState
from kmesh.recovery.waves import waves

# What the worker keeps for recovery, at most (kv_connector_extra_config "recovery_bytes").
DEFAULT_RECOVERY_BYTES = 1 << 30
# Claimed rows of a round's siblings recovered in one batch, at most (one may exceed it); a batch
# holds ~6x its rows' KV at once (placed mirrors, recovered rows, copies): 32 siblings of 1900
# rows took vLLM's worker past 14 GB (docs/design/performance.md); 8192 rows keep ~1.5 GB.
ROUND_BATCH_TOKENS = 8192
# Claimed rows of per-request jobs recovered in one batch, at most (waves.py).
WAVE_TOKENS = 2048


class RequestRecovery:
    """Holds the executor, the stored segment KV and the rounds' masters of one engine."""

    def __init__(
        self,
        executor: Executor,
        fingerprint: str,
        max_bytes: int = DEFAULT_RECOVERY_BYTES,
        page_size: int | None = None,
        shared: SharedState | None = None,
    ) -> None:
        """`page_size`: the engine's page in tokens, for prompts' tails past whole pages
        (prefix_tails.py; None keeps none). `shared`: see `share`."""
        self.executor = executor
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.ledger = Ledger(max_bytes)
        tails = None if page_size is None else PrefixTails(fingerprint, page_size)
        self.continuations = Continuations(self.ledger, self._hold, tails)
        self.segments = SegmentStore(fingerprint, executor.config, self.ledger, self._hold)
        self._commons = CommonMasters(executor, self.segments, self.ledger, self._hold)
        self._masters: dict[RoundKey, tuple[tuple[int, ...], Master]] = {}  # (tokens, master)
        self.shared_masters: SharedMasters | None = None
        if shared is not None:
            self.share(shared)

    def share(self, shared: SharedState) -> None:
        """Share rounds' masters, jobs' transcripts and first readers' segments beyond this
        engine (see the module docstring and segment_store.py)."""
        self.shared_masters = shared.masters
        self.continuations.transcripts = shared.transcripts
        self.segments.shared = shared.segments

    def run(
        self, jobs: Sequence[RecoveryJob], pages: PrefixReader, write: Writer
    ) -> dict[str, RecoveredRows]:
        """Recover one step's jobs: per-request ones in waves (waves.py: one executor batch
        each; a job that reuses a segment an earlier one stores, or reads pages it fills, waits
        for the next wave), then each round's siblings together, in batches of at most
        ROUND_BATCH_TOKENS claimed rows (the first batch builds the master, the next mirror it),
        so that a round's working memory stays bounded. Each outcome goes to `write` before a
        later batch is recovered (a later job of the step may read its rows as prefix: an
        engine's prefix cache can hand it pages this step fills), then its transcript is
        published. A job whose prefix a restored transcript or a kept tail continues starts
        after it (those rows are written as they are). Returns the outcomes without rows."""
        outcomes: dict[str, RecoveredRows] = {}
        rounds: dict[RoundKey, list[RecoveryJob]] = {}
        restored: dict[str, Restored] = {}
        steps = self.continuations
        self.segments.begin_step()
        singles = []
        for job in jobs:
            round_ = job.spec.round
            if round_ is None or job.family is None:
                singles.append(job)
            else:
                rounds.setdefault(RoundKey(job.tenant, job.family, round_.id), []).append(job)
        lacking, page = self.segments.lacking, self.page_size
        for wave in waves(singles, lacking, self._config, page, WAVE_TOKENS):
            outcomes.update(self._per_request(wave, pages, write, restored))
        for key, siblings in rounds.items():
            for chunk in _chunks(siblings):
                tails = TailPages(pages)
                resumed = [steps.continued(job, tails, restored) for job in chunk]
                done = self._round(key, resumed, tails)
                for job in chunk:
                    outcome = steps.finish(job, done.pop(job.request_id), tails, restored)
                    outcomes[job.request_id] = steps.write(job, outcome, pages, write, restored)
        return outcomes

    # -- per request -----------------------------------------------------------------------

    def _per_request(
        self,
        wave: list[RecoveryJob],
        pages: PrefixReader,
        write: Writer,
        restored: dict[str, Restored],
    ) -> dict[str, RecoveredRows]:
        """One wave's jobs (waves.py) in one executor batch; a shared segment a job computed
        in full is stored for the waves after it."""
        steps = self.continuations
        tails = TailPages(pages)
        resumed = [steps.continued(job, tails, restored) for job in wave]
        regions = [
            self._region(job, tails, self.segments.placed(job), self.segments.storing_end(job))
            for job in resumed
        ]
        recovered = recover(self.executor, regions, self._config(wave[0]))
        outcomes = {}
        for job, rest, region, out in zip(wave, resumed, regions, recovered, strict=True):
            if not out.fell_back:
                self.segments.store_computed(rest, region.reusable, out.k, out.v)
            outcome = _outcome(out, region)
            if outcome.k is not None and outcome.v is not None:
                rows = rest.end - rest.start  # the claimed rows; the rest was computed to be stored
                outcome = RecoveredRows(outcome.report, outcome.k[:, :rows], outcome.v[:, :rows])
            outcome = steps.finish(job, outcome, tails, restored)
            outcomes[job.request_id] = steps.write(job, outcome, pages, write, restored)
        return outcomes

    # -- collective ------------------------------------------------------------------------

    def _round(
        self, key: RoundKey, jobs: list[RecoveryJob], pages: PrefixReader
    ) -> dict[str, RecoveredRows]:
        """A round's siblings of this step through kmesh.recovery.collective; without a kept
        master, the first is the master sibling ("sibling" choice) or the master is recovered in
        the family's common context first ("common")."""
        round_ = jobs[0].spec.round
        assert round_ is not None
        shared_cost = 0.0
        tokens = tuple(t for s in jobs[0].round_spans() for t in jobs[0].token_ids[s.start : s.end])
        kept = self._masters.get(key)  # a master of other outputs under this round id: a miss
        master = kept[1] if kept is not None and kept[0] == tokens else None
        if master is not None:
            self.ledger.touch(HeldMaster(key))
        elif self.shared_masters is not None:
            master = self.shared_masters.get(key, round_.master, tokens)
            if master is not None:
                self._keep_master(key, tokens, master)
        if master is None and round_.master == "common":
            master, shared_cost = self._commons.master(key.tenant, key.family, jobs[0])
            self._keep_master(key, tokens, master)
            self._share(key, round_.master, tokens, master)
        siblings = [
            self._sibling(job, pages, master is None and i == 0) for i, job in enumerate(jobs)
        ]
        result = recover_round(self.executor, siblings, self._config(jobs[0]), MASTER_BLOCK, master)
        if result.built:
            self._keep_master(key, tokens, result.master)
            self._share(key, round_.master, tokens, result.master)
        built = result.built or shared_cost > 0
        outcomes = {}
        for i, (job, out) in enumerate(zip(jobs, result.siblings, strict=True)):
            first = built and i == 0
            report = RecoveryReport(
                computed_tokens=out.recovered.computed_tokens,
                shared_computed_tokens=shared_cost if first else 0.0,
                master_bytes=result.master.nbytes if first else 0,
                mirror_bytes=out.mirror_bytes,
                reused_tokens=out.reused_tokens,
                deviation=out.recovered.deviation,
                fell_back=out.recovered.fell_back,
            )
            rows = job.end - job.start  # a master sibling may have computed more, to hold it
            if out.recovered.fell_back:
                outcomes[job.request_id] = RecoveredRows(report, None, None)
                continue
            known = None if first else job.start  # gives_back_from: diffed from its rows
            mirrors = RoundMirrors(key, round_.master, tokens, result.master, out.mirrors, known)
            k, v = out.recovered.k[:, :rows], out.recovered.v[:, :rows]
            outcomes[job.request_id] = RecoveredRows(report, k, v, mirrors)
        return outcomes

    def _sibling(self, job: RecoveryJob, pages: PrefixReader, holds_master: bool) -> SiblingInput:
        """The job as a round sibling: its claimed rows (a master sibling's to the end of the
        round's last segment, which may reach the prompt's last token: those tokens are computed
        twice), its exact prefix read back from vLLM's pages."""
        spans = [(s.start, s.end) for s in job.round_spans()]
        end = max(job.end, *(hi for _, hi in spans)) if holds_master else job.end
        return SiblingInput(
            torch.tensor(job.token_ids[job.start : end]),
            job.start,
            self._prefix(job, pages),
            spans,
        )

    def _keep_master(self, key: RoundKey, tokens: tuple[int, ...], master: Master) -> None:
        self._masters[key] = (tokens, master)
        self._hold(HeldMaster(key), master.nbytes)

    def _share(self, key: RoundKey, choice: str, tokens: Sequence[int], master: Master) -> None:
        if self.shared_masters is not None:
            self.shared_masters.put(key, choice, tokens, master)

    # -- shared pieces ---------------------------------------------------------------------

    def _region(
        self,
        job: RecoveryJob,
        pages: PrefixReader,
        reused: dict[int, Placed],
        end: int | None = None,
    ) -> RegionInput:
        """The claimed rows (to `end`, by default the claim's) as a region: reused rows where
        `reused` covers them, the exact prefix read back from vLLM's pages."""
        end = job.end if end is None else end
        t = end - job.start
        k = blank_kv(self.executor, t)
        v = blank_kv(self.executor, t)
        reusable = torch.zeros(t, dtype=torch.bool)
        segment = torch.zeros(t, dtype=torch.int64)
        for i, span in enumerate(job.spans):
            lo, hi = max(span.start, job.start), min(span.end, end)
            if lo >= hi:
                continue
            segment[lo - job.start : hi - job.start] = i
            if i in reused:
                held = reused[i]
                lo, hi = max(held.start, job.start), min(held.end, end)
                if lo >= hi:
                    continue
                rows = slice(lo - job.start, hi - job.start)
                k[:, rows] = held.k[:, lo - held.start : hi - held.start]
                v[:, rows] = held.v[:, lo - held.start : hi - held.start]
                reusable[rows] = True
        return RegionInput(
            torch.tensor(job.token_ids[job.start : end]),
            torch.arange(job.start, end),
            self._prefix(job, pages),
            k,
            v,
            reusable,
            segment,
        )

    def _prefix(self, job: RecoveryJob, pages: PrefixReader) -> DenseKV | None:
        """The exact KV of rows [0, start), read back from vLLM's pages."""
        if job.start == 0:
            return None
        positions = torch.arange(job.start)
        k, v = pages.read(job.block_ids, positions)
        return DenseKV(positions, list(k), list(v))

    def _config(self, job: RecoveryJob) -> RecoveryConfig:
        spec = job.spec
        return RecoveryConfig(
            spec.policy,
            spec.ratio,
            spec.check_layer,
            spec.gate,
            recompute_on_gate=False,
            gate_sample=spec.gate_sample,
        )

    def _hold(self, key: Held, nbytes: int) -> None:
        """Keep `key`'s state within the ledger's bound, dropping the least recently used."""
        for dropped in self.ledger.hold(key, nbytes):
            if isinstance(dropped, HeldSegment):
                self.segments.discard(dropped.tenant, dropped.tokens, dropped.context)
            elif isinstance(dropped, HeldMaster):
                self._masters.pop(dropped.round, None)
            elif isinstance(dropped, HeldTail):
                self.continuations.discard(dropped)
            else:
                self._commons.discard(dropped.tenant, dropped.family)


def _outcome(recovered: Recovered, region: RegionInput) -> RecoveredRows:
    report = RecoveryReport(
        computed_tokens=recovered.computed_tokens,
        shared_computed_tokens=0.0,
        master_bytes=0,
        mirror_bytes=0,
        reused_tokens=int(region.reusable.sum()) - len(recovered.recomputed),
        deviation=recovered.deviation,
        fell_back=recovered.fell_back,
    )
    if recovered.fell_back:
        return RecoveredRows(report, None, None)
    return RecoveredRows(report, recovered.k, recovered.v)


def _chunks(siblings: list[RecoveryJob]) -> list[list[RecoveryJob]]:
    """The round's siblings in order, in batches of at most ROUND_BATCH_TOKENS claimed rows."""
    chunks: list[list[RecoveryJob]] = []
    rows = 0
    for job in siblings:
        if chunks and rows + job.end - job.start <= ROUND_BATCH_TOKENS:
            chunks[-1].append(job)
            rows += job.end - job.start
        else:
            chunks.append([job])
            rows = job.end - job.start
    return chunks
