"""Collective recovery: one round's shared recovery done once, then per sibling only its own part.

In an All-Gather round N siblings read the same N output segments, each after its own private
history and in its own order. Per-request recovery (CacheBlend, EPIC) repeats the same work in every
sibling. Collective recovery splits it:

1. Shared, once per round: the segments are laid out in canonical order right after a common
   context (what every sibling shares: the system prompt and the earlier rounds' masters) and
   recovered there with the shared config, starting from the segments' stored KV (e.g. each
   output's KV from its author's context); at ratio 1.0 that is a plain prefill of the segments.
   This makes the cross-segment attention among the outputs right, which an author's context
   cannot give. The result becomes the round's dense master (kv/master_mirror.py).
2. Per sibling: its mirror places the master's segments in its order after its prefix (one fused
   gather + re-rotation), and the policy recomputes `agent_ratio` of the region's blocks: the blocks
   its private history disturbs most (kv_deviation), the first of each segment (first_k) or random
   ones. Whole blocks, because the sibling stores exactly those blocks as its block-sparse diff;
   every other block keeps the master's KV, so the diff stays sparse and restore is bit-identical.
   The sibling's own tail (its instruction) is computed in full.

What stays approximate: each sibling's uncorrected blocks attended to the common context, not to
its private history and its order. Benchmarks measure how far that is from full prefill. The cost
is one shared recovery per round plus, per sibling, its correction and its tail: linear in the
number of siblings, where per-request recovery of N outputs in N siblings grows as N squared.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.executor import DenseKV, Executor
from kmesh.kv.master_mirror import Master, Mirror, restore
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.recover import Recovered, RecoveryConfig, RegionInput, recover


@dataclass(frozen=True, slots=True)
class SharedSegment:
    token_ids: torch.Tensor  # [n]
    stored: SegmentKV  # KV at canonical positions; rows that are not `reusable` are ignored
    reusable: torch.Tensor  # [n] bool


@dataclass(frozen=True, slots=True)
class Sibling:
    prefix: DenseKV  # its exact context before the segments
    order: Sequence[int]  # the segment indices in the order it reads them
    tail: torch.Tensor  # tokens after the segments, computed in full (its instruction)


@dataclass(frozen=True, slots=True)
class SiblingResult:
    recovered: Recovered  # region = the segments in its order, then its tail
    mirror: Mirror  # its segments' KV as a diff against the master


@dataclass(frozen=True, slots=True)
class CollectiveRound:
    master: Master
    shared: Recovered
    siblings: list[SiblingResult]

    @property
    def computed_tokens(self) -> float:
        return self.shared.computed_tokens + sum(s.recovered.computed_tokens for s in self.siblings)

    @property
    def fallbacks(self) -> int:
        return int(self.shared.fell_back) + sum(s.recovered.fell_back for s in self.siblings)


def recover_round(
    executor: Executor,
    common: DenseKV,
    segments: Sequence[SharedSegment],
    siblings: Sequence[Sibling],
    shared_cfg: RecoveryConfig,
    sibling_cfg: RecoveryConfig,
    block_size: int,
) -> CollectiveRound:
    config = executor.config
    start = int(common.positions.max()) + 1 if len(common.positions) else 0
    lengths = [len(s.token_ids) for s in segments]
    positions = torch.arange(start, start + sum(lengths))
    placed = [
        s.stored.placed(p, config) for s, p in zip(segments, positions.split(lengths), strict=True)
    ]
    shared = recover(
        executor,
        [
            RegionInput(
                torch.cat([s.token_ids for s in segments]),
                positions,
                common,
                torch.cat([k for k, _ in placed], dim=1),
                torch.cat([v for _, v in placed], dim=1),
                torch.cat([s.reusable for s in segments]),
                _segment_of_tokens(lengths),
            )
        ],
        shared_cfg,
    )[0]
    master = Master.build(
        [
            (k, v, p)
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
    return CollectiveRound(
        master, shared, _recover_siblings(executor, master, segments, siblings, sibling_cfg)
    )


def _recover_siblings(
    executor: Executor,
    master: Master,
    segments: Sequence[SharedSegment],
    siblings: Sequence[Sibling],
    cfg: RecoveryConfig,
) -> list[SiblingResult]:
    config = executor.config
    lengths = [len(s.token_ids) for s in segments]
    regions = []
    mirrors = []
    for sibling in siblings:
        start = int(sibling.prefix.positions.max()) + 1 if len(sibling.prefix.positions) else 0
        mirror = Mirror.of(master, sibling.order, start)
        k, v = restore(master, mirror, config)
        span = k.shape[1]
        tail = len(sibling.tail)
        blank = torch.zeros((k.shape[0], tail, *k.shape[2:]), dtype=k.dtype)
        block = mirror.block_of_token()
        regions.append(
            RegionInput(
                torch.cat([segments[i].token_ids for i in sibling.order] + [sibling.tail]),
                torch.arange(start, start + span + tail),
                sibling.prefix,
                torch.cat((k, blank), dim=1),
                torch.cat((v, blank), dim=1),
                torch.cat(
                    (torch.ones(span, dtype=torch.bool), torch.zeros(tail, dtype=torch.bool))
                ),
                _segment_of_tokens([lengths[i] for i in sibling.order] + [tail]),
                # Tail tokens get block ids of their own (never chosen: not reusable).
                torch.cat((block, int(block.max()) + 1 + torch.arange(tail))),
                keep_reused_outside_selection=True,
            )
        )
        mirrors.append(mirror)
    results = []
    for mirror, recovered in zip(mirrors, recover(executor, regions, cfg), strict=True):
        span = len(mirror.positions)
        corrected = torch.unique(mirror.block_of_token()[recovered.recomputed])
        diff = mirror.with_diff(master, recovered.k[:, :span], recovered.v[:, :span], corrected)
        results.append(SiblingResult(recovered, diff))
    return results


def _segment_of_tokens(lengths: Sequence[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
