"""Collective recovery (both master choices) on the tiny model: plumbing against full prefill,
the master sibling exact, sparse exact mirrors, regions that begin inside a round segment."""

import pytest
import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.kv.master_mirror import kv_digest
from kmesh.kv.mirror_restore import restore
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.collective import SiblingInput, recover_round
from kmesh.recovery.common_master import CommonContext, SharedSegment, master_in_common
from kmesh.recovery.recover import RecoveryConfig
from tests.conftest import random_tokens

ATOL = 1e-4  # see tests/recovery/test_recover.py
BLOCK = 4
LENGTHS = (7, 12, 5)
COMMON = random_tokens(6, seed=1)
SEGMENTS = [random_tokens(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
SIBLINGS = [  # (private history after the common tokens, reading order, tail)
    (random_tokens(4, seed=20), (2, 0, 1), random_tokens(3, seed=30)),
    (random_tokens(9, seed=21), (1, 2, 0), random_tokens(2, seed=31)),
    (random_tokens(2, seed=22), (0, 1, 2), random_tokens(4, seed=32)),
]


def _kv(executor: Executor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = executor.forward([SequenceInput(torch.tensor(tokens), torch.arange(len(tokens)))])[0]
    return torch.stack(out.k), torch.stack(out.v)


def _prompt(private: list[int], order: tuple[int, ...], tail: list[int]) -> list[int]:
    return COMMON + private + [t for i in order for t in SEGMENTS[i]] + tail


def _sibling(executor: Executor, index: int, region_start: int | None = None) -> SiblingInput:
    """Sibling `index` with its exact prefix (its common tokens and history, or up to
    `region_start`) and its region after it."""
    private, order, tail = SIBLINGS[index]
    prompt = _prompt(private, order, tail)
    start = len(COMMON) + len(private) if region_start is None else region_start
    k, v = _kv(executor, prompt[:start])
    spans: list[tuple[int, int]] = [(0, 0)] * len(SEGMENTS)
    at = len(COMMON) + len(private)
    for i in order:
        spans[i] = (at, at + LENGTHS[i])
        at += LENGTHS[i]
    return SiblingInput(
        torch.tensor(prompt[start:]),
        start,
        DenseKV(torch.arange(start), list(k), list(v)),
        spans,
    )


def _exact(executor: Executor, index: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _kv(executor, _prompt(*SIBLINGS[index]))
    return k[:, start:], v[:, start:]


def _run(executor: Executor, policy: str, ratio: float):
    siblings = [_sibling(executor, i) for i in range(len(SIBLINGS))]
    return siblings, recover_round(executor, siblings, RecoveryConfig(policy, ratio), BLOCK)


def test_the_master_sibling_is_computed_exactly_and_is_the_master(tiny):
    executor, _ = tiny
    siblings, result = _run(executor, "kv_deviation", 0.0)
    first = result.siblings[0]
    k, v = _exact(executor, 0, siblings[0].start)
    torch.testing.assert_close(first.recovered.k, k, atol=ATOL, rtol=0)
    torch.testing.assert_close(first.recovered.v, v, atol=ATOL, rtol=0)
    assert result.built
    # Its mirror has no diff and restores its own KV bit-identically (its keys turn by 0).
    (mirror,) = first.mirrors
    assert len(mirror.diff_index) == 0
    restored_k, restored_v = restore(result.master, mirror, executor.config)
    span = len(mirror.positions)
    assert torch.equal(restored_k, first.recovered.k[:, :span])
    assert torch.equal(restored_v, first.recovered.v[:, :span])


def test_policy_full_equals_full_prefill_of_every_sibling(tiny):
    executor, _ = tiny
    siblings, result = _run(executor, "full", 1.0)
    for i, (sibling, out) in enumerate(zip(siblings, result.siblings, strict=True)):
        k, v = _exact(executor, i, sibling.start)
        torch.testing.assert_close(out.recovered.k, k, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.recovered.v, v, atol=ATOL, rtol=0)


def test_mirrored_siblings_without_correction_compute_only_their_own_tokens(tiny):
    executor, _ = tiny
    siblings, result = _run(executor, "none", 0.0)
    span = sum(LENGTHS)
    for (_, _, tail), sibling in zip(SIBLINGS[1:], result.siblings[1:], strict=True):
        (mirror,) = sibling.mirrors
        assert len(mirror.diff_index) == 0
        assert sibling.recovered.computed_tokens == len(tail)
        k, v = restore(result.master, mirror, executor.config)
        assert torch.equal(k, sibling.recovered.k[:, :span])
        assert torch.equal(v, sibling.recovered.v[:, :span])
    first = result.siblings[0].recovered.computed_tokens
    assert result.computed_tokens == first + sum(len(t) for _, _, t in SIBLINGS[1:])
    assert first == len(siblings[0].token_ids)


def test_corrected_blocks_become_the_exact_sparse_diff(tiny):
    executor, _ = tiny
    _, result = _run(executor, "kv_deviation", 0.5)
    span = sum(LENGTHS)
    blocks = sum(-(-n // BLOCK) for n in LENGTHS)
    for sibling in result.siblings[1:]:
        (mirror,) = sibling.mirrors
        corrected = torch.unique(mirror.block_of_token()[sibling.recovered.recomputed])
        assert torch.equal(mirror.diff_index, corrected)
        assert 0 < len(corrected) < blocks
        k, v = restore(result.master, mirror, executor.config)
        assert kv_digest(k, v) == kv_digest(
            sibling.recovered.k[:, :span], sibling.recovered.v[:, :span]
        )
        assert mirror.nbytes < mirror.dense_nbytes()


def test_a_given_master_serves_a_sibling_that_arrives_later(tiny):
    executor, _ = tiny
    siblings, result = _run(executor, "none", 0.0)
    later = recover_round(
        executor, [siblings[2]], RecoveryConfig("none", 0.0), BLOCK, result.master
    )
    assert not later.built
    span = sum(LENGTHS)  # the placed rows are the master's, bit for bit; the tail is computed
    alone, batched = later.siblings[0].recovered.k, result.siblings[2].recovered.k
    assert torch.equal(alone[:, :span], batched[:, :span])
    torch.testing.assert_close(alone, batched, atol=ATOL, rtol=0)


def test_a_region_starting_inside_a_round_segment_reads_the_rest_from_the_prefix(tiny):
    executor, _ = tiny
    inside = len(COMMON) + len(SIBLINGS[0][0]) + 3  # 3 tokens into its first segment
    first = _sibling(executor, 0, region_start=inside)
    result = recover_round(executor, [first], RecoveryConfig("none", 0.0), BLOCK)
    whole_k, _ = _kv(executor, _prompt(*SIBLINGS[0]))
    (mirror,) = result.siblings[0].mirrors
    restored_k, _ = restore(result.master, mirror, executor.config)
    torch.testing.assert_close(restored_k, whole_k[:, mirror.positions], atol=ATOL, rtol=0)
    # A mirrored sibling whose region starts inside a segment is placed only where it computes.
    second = _sibling(executor, 1, region_start=len(COMMON) + len(SIBLINGS[1][0]) + 5)
    out = recover_round(executor, [second], RecoveryConfig("none", 0.0), BLOCK, result.master)
    assert out.siblings[0].recovered.k.shape[1] == len(second.token_ids)


def test_a_corrected_sibling_whose_region_starts_inside_a_segment_restores_its_rows(tiny):
    executor, _ = tiny
    _, result = _run(executor, "none", 0.0)
    into = 5  # its region starts 5 tokens into its first segment: that run is placed whole
    second = _sibling(executor, 1, region_start=len(COMMON) + len(SIBLINGS[1][0]) + into)
    cfg = RecoveryConfig("kv_deviation", 0.5)
    out = recover_round(executor, [second], cfg, BLOCK, result.master).siblings[0]
    assert len(out.recovered.recomputed) > 0
    (mirror,) = out.mirrors
    assert len(mirror.diff_index) > 0
    k, v = restore(result.master, mirror, executor.config)
    span = sum(LENGTHS) - into  # the run's rows in the region, then the computed tail
    assert torch.equal(k[:, into:], out.recovered.k[:, :span])
    assert torch.equal(v[:, into:], out.recovered.v[:, :span])


def test_the_master_sibling_must_hold_every_round_segment(tiny):
    executor, _ = tiny
    sibling = _sibling(executor, 0)
    cut = SiblingInput(sibling.token_ids[:5], sibling.start, sibling.prefix, sibling.spans)
    with pytest.raises(ValueError, match="ends after the master sibling's region"):
        recover_round(executor, [cut], RecoveryConfig("none", 0.0), BLOCK)


def test_the_common_choice_recovers_the_segments_once_after_the_common_context(tiny):
    executor, _ = tiny
    k, v = _kv(executor, COMMON)
    common = CommonContext(k, v)
    segments = []
    for tokens in SEGMENTS:  # KV computed alone (a wrong context): what recovery repairs
        sk, sv = _kv(executor, tokens)
        stored = SegmentKV.canonical(sk, sv, torch.arange(len(tokens)), executor.config)
        segments.append(
            SharedSegment(torch.tensor(tokens), stored, torch.ones(len(tokens), dtype=torch.bool))
        )
    master, shared = master_in_common(
        executor, common, segments, RecoveryConfig("full", 1.0), BLOCK
    )
    exact_k, _ = _kv(executor, COMMON + [t for s in SEGMENTS for t in s])
    torch.testing.assert_close(shared.k, exact_k[:, len(COMMON) :], atol=ATOL, rtol=0)
    assert master.segment_starts == (6, 13, 25)
    common.extend(shared)
    assert common.length == len(COMMON) + sum(LENGTHS)
    # Every sibling is then a mirror of that master; policy full makes each exact.
    siblings = [_sibling(executor, i) for i in range(len(SIBLINGS))]
    result = recover_round(executor, siblings, RecoveryConfig("full", 1.0), BLOCK, master)
    for i, (sibling, out) in enumerate(zip(siblings, result.siblings, strict=True)):
        k, _ = _exact(executor, i, sibling.start)
        torch.testing.assert_close(out.recovered.k, k, atol=ATOL, rtol=0)
