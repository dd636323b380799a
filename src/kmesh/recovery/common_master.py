"""The "common" master choice of a round (kmesh/recovery/collective.py::master_in_common), as
both engines' recovery keeps it: per (tenant, family), the family's common context (its leading
shared segments, computed on first use, then every earlier round's master segments), and each
round's master recovered after it from the segments' stored KV (kmesh/recovery/segment_store.py)
at the round's `shared_ratio`. The contexts are held in the recovery ledger (HeldCommon: tenant,
family); a dropped one restarts from the family's leading shared segments.
"""

import itertools
from collections.abc import Callable

import torch

from kmesh.compute.executor import Executor, SequenceInput
from kmesh.kv.master_mirror import Master
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.collective import (
    MASTER_BLOCK,
    CommonContext,
    SharedSegment,
    blank_kv,
    master_in_common,
)
from kmesh.recovery.jobs import RecoveryJob
from kmesh.recovery.ledger import Held, HeldCommon, Ledger
from kmesh.recovery.recover import RecoveryConfig
from kmesh.recovery.segment_store import SegmentStore
from kmesh.state.segments import trunk_end


class CommonMasters:
    def __init__(
        self,
        executor: Executor,
        segments: SegmentStore,
        ledger: Ledger,
        hold: Callable[[Held, int], None],
    ) -> None:
        """`hold(key, nbytes)` keeps a context within the ledger's bound (RequestRecovery's)."""
        self.executor = executor
        self.segments = segments
        self.ledger = ledger
        self._hold = hold
        self._contexts: dict[tuple[str | None, str], CommonContext] = {}

    def master(self, tenant: str | None, family: str, job: RecoveryJob) -> tuple[Master, float]:
        """The round's master for `job`'s round, and what it cost (token-layers / layers: the
        common context's first computation, if this call made it, and the master's recovery)."""
        round_ = job.spec.round
        assert round_ is not None
        common, cost = self._context(tenant, family, job)
        segments = []
        for span in job.round_spans():
            tokens = job.token_ids[span.start : span.end]
            stored = self.segments.get(tenant, tokens)
            reusable = torch.full((len(tokens),), stored is not None)
            if stored is None:  # computed in the common context
                blank = blank_kv(self.executor, len(tokens))
                stored = SegmentKV(blank, blank)
            segments.append(SharedSegment(torch.tensor(tokens), stored, reusable))
        spec = job.spec
        cfg = RecoveryConfig(
            spec.policy,
            round_.shared_ratio,
            spec.check_layer,
            spec.gate,
            gate_sample=spec.gate_sample,
        )
        master, shared = master_in_common(self.executor, common, segments, cfg, MASTER_BLOCK)
        common.extend(shared)
        self._hold(HeldCommon(tenant, family), common.nbytes)
        return master, cost + shared.computed_tokens

    def discard(self, tenant: str | None, family: str) -> None:
        self._contexts.pop((tenant, family), None)

    def _context(
        self, tenant: str | None, family: str, job: RecoveryJob
    ) -> tuple[CommonContext, float]:
        """The family's common context; its leading shared segments are computed on first use."""
        common = self._contexts.get((tenant, family))
        if common is not None:
            self.ledger.touch(HeldCommon(tenant, family))
            return common, 0.0
        round_ids = set(job.spec.round.segments) if job.spec.round is not None else set()
        trunk = trunk_end(itertools.takewhile(lambda s: s.segment_id not in round_ids, job.spans))
        if trunk == 0:
            blank = blank_kv(self.executor, 0)
            common = CommonContext(blank, blank)
        else:
            out = self.executor.forward(
                [SequenceInput(torch.tensor(job.token_ids[:trunk]), torch.arange(trunk))]
            )[0]
            common = CommonContext(torch.stack(out.k), torch.stack(out.v))
        self._contexts[(tenant, family)] = common
        return common, float(trunk)
