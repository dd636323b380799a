"""Collective recovery of All-Gather rounds: one mechanism for both engines.

In an All-Gather round N siblings read the same N output segments, each after its own exact
prefix, in its own order, at its own positions. Per-request recovery (CacheBlend, EPIC) repeats the
same repair in every sibling; collective recovery pays for the shared part once per round and
keeps it as the round's dense master (kv/master_mirror.py), which every other sibling reads through
its mirror. The caller (the reference bench, the reference engine's runner, vLLM's worker half)
only says what a sibling is: its region (the tokens after its exact prefix), that prefix's KV, and
where the round's segments lie in its prompt (`SiblingInput`).

Where the master comes from (`MASTER_CHOICES`):
- "sibling" (TokenDance's choice: the request closest to the common structure is a real sibling):
  the round's first sibling is computed exactly (policy full) and its own KV of the round's
  segments is the master. It costs nothing beyond that sibling's own prefill, and the master has
  seen a real sibling's whole context (system prompt, persona, history).
- "common": the segments laid out in canonical order after the family's common context (its
  leading shared segments and every earlier round's master: `CommonContext`) and recovered there
  from their stored KV at the shared config (ratio 1.0: a plain prefill of the segments);
  `master_in_common` (common_master.py). This costs one extra prefill of the segments per round.

Every other sibling (`recover_siblings`): its mirrors place the master's segments at its
positions in its order (one mirror per contiguous run of round segments: one fused gather + RoPE
call each), and the policy recomputes the config's `ratio` of the placed blocks (whole blocks:
kv_deviation the ones its own history disturbs most, first_k the first of each segment, query
the ones its own tokens attend to most, random, or a mix: recovery/policies.py); tokens outside
the round's segments are computed. Uncorrected blocks keep the master's KV exactly, so each
mirror's diff is block-sparse (the recomputed blocks) and `restore` gives the sibling's
KV back bit-identically; the master sibling's mirrors have an empty diff (its keys turn by 0).

What stays approximate: a mirrored sibling's uncorrected blocks attended to the master sibling's
context (or the common context), not to its own. Benchmarks measure how far that is from full
prefill; the gate (recover.py) falls back to full computation of a region that deviates too much.
Cost: the master sibling's prefill, then per sibling its correction and its own tokens: linear in
the number of siblings, where per-request recovery of N outputs in N siblings grows as N squared.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.executor import DenseKV, Executor
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror
from kmesh.kv.mirror_restore import restore, restore_into
from kmesh.recovery.recover import Recovered, RecoveryConfig, RegionInput, recover

MASTER_CHOICES = ("sibling", "common")
EXACT = RecoveryConfig("full", 1.0)
# Block granularity of a round's master (the store's unit; independent of an engine's pages).
MASTER_BLOCK = 16


@dataclass(frozen=True, slots=True)
class SiblingInput:
    """One sibling's request as a region: what follows its exact prefix."""

    token_ids: torch.Tensor  # [t] the region's tokens
    start: int  # position of token_ids[0]; `prefix` holds positions [0, start)
    prefix: DenseKV | None
    # [lo, hi) prompt positions of each round segment, in the round's canonical order; a segment
    # may begin inside the prefix (its KV there is exact already) but must end by the region's end
    # for the master sibling.
    spans: Sequence[tuple[int, int]]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SiblingResult:
    recovered: Recovered  # over the whole region
    mirrors: tuple[Mirror, ...]  # one per contiguous run of round segments; diff = its corrections
    reused_tokens: int  # region tokens whose KV is the master's (placed, not recomputed)

    @property
    def mirror_bytes(self) -> int:
        return sum(m.nbytes for m in self.mirrors)


@dataclass(frozen=True, slots=True)
class RoundResult:
    master: Master
    built: bool  # this call built the master from its first sibling
    siblings: list[SiblingResult]  # in the order given

    @property
    def computed_tokens(self) -> float:
        return sum(s.recovered.computed_tokens for s in self.siblings)


def recover_round(
    executor: Executor,
    siblings: Sequence[SiblingInput],
    cfg: RecoveryConfig,
    block_size: int,
    master: Master | None = None,
) -> RoundResult:
    """Recover a round's siblings (those at hand: a round may arrive over several calls).
    Without a master, the first sibling is computed exactly and becomes it ("sibling" choice);
    the others are mirrored from the master and corrected by `cfg`."""
    if not siblings:
        raise ValueError("a round needs at least one sibling")
    built = master is None
    results: list[SiblingResult] = []
    rest = list(siblings)
    if master is None:
        first = rest.pop(0)
        recovered = recover(executor, [_plain_region(executor, first)], EXACT)[0]
        master = master_of_sibling(first, recovered, block_size, executor)
        mirrors = tuple(Mirror.of(master, order, lo) for lo, order in _runs(first.spans))
        results.append(SiblingResult(recovered, mirrors, 0))
    results.extend(recover_siblings(executor, master, rest, cfg))
    return RoundResult(master, built, results)


def master_of_sibling(
    sibling: SiblingInput, recovered: Recovered, block_size: int, executor: Executor
) -> Master:
    """The round's master from a sibling's exact KV (its prefix, then its recovered region)."""
    segments = []
    for lo, hi in sibling.spans:
        if hi > sibling.end:
            raise ValueError(
                f"round segment [{lo}, {hi}) ends after the master sibling's region "
                f"(to {sibling.end}): the master needs every segment's KV"
            )
        k, v = _exact_rows(sibling, recovered, lo, hi)
        segments.append(MasterSegment(k, v, torch.arange(lo, hi, device=k.device)))
    return Master.build(segments, block_size, executor.config)


def recover_siblings(
    executor: Executor, master: Master, siblings: Sequence[SiblingInput], cfg: RecoveryConfig
) -> list[SiblingResult]:
    """Mirror the master into each sibling's region and correct it by `cfg` (one batch)."""
    placed = [_placed_region(executor, master, s) for s in siblings]
    recovered = recover(executor, [p.region for p in placed], cfg) if placed else []
    results = []
    for sibling, p, out in zip(siblings, placed, recovered, strict=True):
        region, mirrors = p.region, p.mirrors
        reused = int(region.reusable.sum()) - len(out.recomputed)
        if out.fell_back and not cfg.recompute_on_gate:
            results.append(SiblingResult(out, mirrors, 0))
            continue
        assert region.block is not None
        corrected = region.block[out.recomputed]  # units: mirror index << 32 | mirror block
        diffed = []
        for index, (mirror, kept) in enumerate(zip(mirrors, p.copies, strict=True)):
            # The run's KV as the sibling now holds it: the master's, corrected where recomputed.
            if kept is None:  # its rows of the placed buffer, which recovery wrote (scratch)
                at = mirror.rows(p.origin)
                k, v = p.k[:, at], p.v[:, at]
            else:
                inside, rows = _inside(mirror, sibling)
                k, v = kept
                k[:, inside] = out.k[:, rows]
                v[:, inside] = out.v[:, rows]
            blocks = torch.unique(corrected[(corrected >> 32) == index] & 0xFFFFFFFF)
            diffed.append(mirror.with_diff(master, k, v, blocks))
        results.append(SiblingResult(out, tuple(diffed), reused))
    return results


def _runs(spans: Sequence[tuple[int, int]]) -> list[tuple[int, tuple[int, ...]]]:
    """Contiguous runs of round segments: (first position, canonical indices in reading order)."""
    runs: list[tuple[int, list[int]]] = []
    end = -1
    for index in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        lo, hi = spans[index]
        if runs and lo == end:
            runs[-1][1].append(index)
        else:
            runs.append((lo, [index]))
        end = hi
    return [(lo, tuple(order)) for lo, order in runs]


def _plain_region(executor: Executor, sibling: SiblingInput) -> RegionInput:
    """The sibling's region with nothing reused (computed in full)."""
    t = len(sibling.token_ids)
    device = executor.device
    return RegionInput(
        sibling.token_ids,
        torch.arange(sibling.start, sibling.end, device=device),
        sibling.prefix,
        blank_kv(executor, t),
        blank_kv(executor, t),
        torch.zeros(t, dtype=torch.bool, device=device),
        torch.zeros(t, dtype=torch.int64, device=device),
        scratch=True,
    )


def _exact_rows(
    sibling: SiblingInput, recovered: Recovered, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV [L, hi - lo, H, D] of prompt positions [lo, hi): from the prefix, then the region."""
    parts_k, parts_v = [], []
    if lo < sibling.start:
        if sibling.prefix is None:
            raise ValueError(f"round segment [{lo}, {hi}) starts before a region with no prefix")
        upto = min(hi, sibling.start)
        parts_k.append(torch.stack([k[lo:upto] for k in sibling.prefix.k]))
        parts_v.append(torch.stack([v[lo:upto] for v in sibling.prefix.v]))
    if hi > sibling.start:
        rows = slice(max(lo, sibling.start) - sibling.start, hi - sibling.start)
        parts_k.append(recovered.k[:, rows])
        parts_v.append(recovered.v[:, rows])
    return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


@dataclass(frozen=True, slots=True)
class _Placed:
    """A sibling's region with the master's KV placed on its round segments (`_placed_region`).

    The region's KV are rows of one buffer `k`, `v` [L, lead + t, H, D] holding positions from
    `origin` (the region's start less `lead`): a run that begins in the prefix and ends in the
    region is restored whole into it, its `lead` rows before the region's own, so that its KV
    (for its diff) needs no copy. Recovery writes the region's rows in place (`scratch`)."""

    region: RegionInput
    mirrors: tuple[Mirror, ...]
    # Per run: None where its rows lie in the buffer; else a copy of the whole run (one wholly
    # in the prefix, or reaching past the region's end), whose region rows the caller overwrites
    # once recovered.
    copies: list[tuple[torch.Tensor, torch.Tensor] | None]
    k: torch.Tensor
    v: torch.Tensor
    origin: int


def _placed_region(executor: Executor, master: Master, sibling: SiblingInput) -> _Placed:
    """The sibling's region with the master's KV placed on its round segments, and its mirrors.

    Units for whole-block selection: a placed token's unit is (mirror index << 32 | its mirror
    block), every other token a unit of its own (never chosen: not reusable)."""
    t = len(sibling.token_ids)
    device = executor.device
    runs = [(Mirror.of(master, order, lo), order) for lo, order in _runs(sibling.spans)]
    start, end = sibling.start, sibling.end
    lead = max(
        (start - m.start for m, _ in runs if m.start < start < m.start + len(m.positions) <= end),
        default=0,
    )
    origin = start - lead
    k_all, v_all = (
        blank_kv(executor, lead + t, zeros=False),
        blank_kv(executor, lead + t, zeros=False),
    )
    k, v = k_all[:, lead:], v_all[:, lead:]
    reusable = torch.zeros(t, dtype=torch.bool, device=device)
    segment = torch.full((t,), len(sibling.spans), dtype=torch.int64, device=device)
    block = -1 - torch.arange(t, dtype=torch.int64, device=device)
    copies: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for index, (mirror, order) in enumerate(runs):
        inside, rows = _inside(mirror, sibling)
        if origin <= mirror.start and mirror.start + len(mirror.positions) <= end:
            at = mirror.rows(origin)
            restore_into(master, mirror, executor.config, k_all[:, at], v_all[:, at])
            copies.append(None)
        else:  # a run reaching outside the buffer is restored whole, its region rows copied
            kept = restore(master, mirror, executor.config)
            k[:, rows] = kept[0][:, inside]
            v[:, rows] = kept[1][:, inside]
            copies.append(kept)
        reusable[rows] = True
        block[rows] = (index << 32) | mirror.block_of_token()[inside]
        segment_of = torch.repeat_interleave(
            torch.tensor(order, device=device),
            torch.tensor([master.segment_lengths[i] for i in order], device=device),
        )
        segment[rows] = segment_of[inside]
    computed = torch.nonzero(~reusable).flatten()  # the rows to compute: zeros until they are
    k.index_fill_(1, computed, 0)
    v.index_fill_(1, computed, 0)
    region = RegionInput(
        sibling.token_ids,
        torch.arange(start, end, device=device),
        sibling.prefix,
        k,
        v,
        reusable,
        segment,
        block,
        keep_reused_outside_selection=True,
        scratch=True,
    )
    return _Placed(region, tuple(m for m, _ in runs), copies, k_all, v_all, origin)


Rows = slice | torch.Tensor


def _inside(mirror: Mirror, sibling: SiblingInput) -> tuple[Rows, Rows]:
    """(the run's tokens that lie in the region, their rows of the region): slices, views with
    no copies, where the whole run does (its positions are consecutive); else a mask and
    indices."""
    lo, n = mirror.start, mirror.positions.numel()
    if lo >= sibling.start and lo + n <= sibling.end:
        return slice(None), mirror.rows(sibling.start)
    inside = (mirror.positions >= sibling.start) & (mirror.positions < sibling.end)
    return inside, mirror.positions[inside] - sibling.start


def blank_kv(executor: Executor, n: int, zeros: bool = True) -> torch.Tensor:
    """KV [layers, n, kv_heads, head_dim] in the executor's dtype (rows to be filled): zeros, or
    uninitialised where the caller writes every row (`zeros=False`)."""
    c = executor.config
    shape = (c.num_layers, n, c.num_kv_heads, c.head_dim)
    make = torch.zeros if zeros else torch.empty
    return make(shape, dtype=executor.dtype, device=executor.device)
