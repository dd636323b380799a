"""The "common" master choice of a round (kmesh/recovery/collective.py): `master_in_common`
recovers the round's segments once after the family's common context (`CommonContext`); both
engines' recovery keeps it: per (tenant, family), the family's common context (its leading
shared segments, computed on first use, then every earlier round's master segments), and each
round's master recovered after it from the segments' stored KV (kmesh/recovery/segment_store.py)
at the round's `shared_ratio`. The contexts are held in the recovery ledger (HeldCommon: tenant,
family); a dropped one restarts from the family's leading shared segments.
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.kv.master_mirror import Master, MasterSegment
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.collective import EXACT, MASTER_BLOCK, blank_kv
from kmesh.recovery.jobs import RecoveryJob
from kmesh.recovery.ledger import Held, HeldCommon, Ledger
from kmesh.recovery.recover import Recovered, RecoveryConfig, RegionInput, recover
from kmesh.recovery.segment_store import SegmentStore
from kmesh.state.segments import trunk_end


@dataclass(frozen=True, slots=True)
class SharedSegment:
    """A round segment for the "common" choice: its tokens and its stored KV, if any."""

    token_ids: torch.Tensor  # [n]
    stored: SegmentKV  # KV at canonical positions; rows not `reusable` are ignored
    reusable: torch.Tensor  # [n] bool


def master_in_common(
    executor: Executor,
    common: "CommonContext",
    segments: Sequence[SharedSegment],
    cfg: RecoveryConfig,
    block_size: int,
) -> tuple[Master, Recovered]:
    """The "common" choice: the segments recovered once after the common context, in canonical
    order, at `cfg` (ratio 1.0: computed in full). Returns the master and that recovery (its cost;
    `common.extend` takes it for the next round)."""
    config = executor.config
    start = common.length
    lengths = [len(s.token_ids) for s in segments]
    device = executor.device
    positions = torch.arange(start, start + sum(lengths), device=device)
    at = positions.split(lengths)
    placed = [s.stored.placed(p, config) for s, p in zip(segments, at, strict=True)]
    policy_cfg = cfg if cfg.ratio < 1.0 else EXACT
    shared = recover(
        executor,
        [
            RegionInput(
                torch.cat([s.token_ids for s in segments]),
                positions,
                common.dense(),
                torch.cat([k for k, _ in placed], dim=1),
                torch.cat([v for _, v in placed], dim=1),
                torch.cat([s.reusable for s in segments]),
                torch.repeat_interleave(
                    torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
                ),
            )
        ],
        policy_cfg,
    )[0]
    master = Master.build(
        [
            MasterSegment(k, v, p)
            for k, v, p in zip(
                shared.k.split(lengths, dim=1),
                shared.v.split(lengths, dim=1),
                positions.split(lengths),
                strict=True,
            )
        ],
        block_size,
        config,
    )
    return master, shared


@dataclass(slots=True)
class CommonContext:
    """A family's common context ("common" choice): its leading shared segments, then every
    round's master segments in canonical order, at positions 0..n-1."""

    k: torch.Tensor  # [layers, n, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def dense(self) -> DenseKV:
        return DenseKV(torch.arange(self.length, device=self.k.device), list(self.k), list(self.v))

    def extend(self, shared: Recovered) -> None:
        """Append a round's recovered segments (master_in_common's recovery)."""
        self.k = torch.cat((self.k, shared.k), dim=1)
        self.v = torch.cat((self.v, shared.v), dim=1)


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
