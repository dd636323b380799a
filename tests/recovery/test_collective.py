"""Collective recovery on the tiny model: plumbing against full prefill, sparse exact mirrors."""

import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.kv.master_mirror import kv_digest, restore
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.collective import SharedSegment, Sibling, recover_round
from kmesh.recovery.recover import RecoveryConfig
from tests.conftest import random_tokens

ATOL = 1e-4  # see tests/recovery/test_recover.py
LENGTHS = (7, 12, 5)
COMMON = random_tokens(6, seed=1)
SEGMENTS = [random_tokens(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
SIBLINGS = [  # (private prefix after the common tokens, order, tail)
    (random_tokens(4, seed=20), (2, 0, 1), random_tokens(3, seed=30)),
    (random_tokens(9, seed=21), (1, 2, 0), random_tokens(2, seed=31)),
]


def _kv(executor: Executor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = executor.forward([SequenceInput(torch.tensor(tokens), torch.arange(len(tokens)))])[0]
    return torch.stack(out.k), torch.stack(out.v)


def _context(executor: Executor, tokens: list[int]) -> DenseKV:
    k, v = _kv(executor, tokens)
    return DenseKV(torch.arange(len(tokens)), list(k), list(v))


def _round(executor: Executor, policy: str, ratio: float, agent_ratio: float):
    """Segments reused from KV computed alone (a wrong context): what recovery must repair."""
    segments = []
    for tokens in SEGMENTS:
        k, v = _kv(executor, tokens)
        stored = SegmentKV.canonical(k, v, torch.arange(len(tokens)), executor.config)
        reusable = torch.ones(len(tokens), dtype=torch.bool)
        reusable[0] = False  # a header token the stored KV does not cover
        segments.append(SharedSegment(torch.tensor(tokens), stored, reusable))
    siblings = [
        Sibling(_context(executor, COMMON + private), order, torch.tensor(tail))
        for private, order, tail in SIBLINGS
    ]
    return recover_round(
        executor,
        _context(executor, COMMON),
        segments,
        siblings,
        RecoveryConfig(policy, ratio),
        RecoveryConfig(policy, agent_ratio),
        block_size=4,
    )


def test_policy_full_equals_full_prefill_of_every_prompt(tiny):
    executor, _ = tiny
    result = _round(executor, "full", 1.0, 1.0)
    shared_k, _ = _kv(executor, COMMON + [t for s in SEGMENTS for t in s])
    torch.testing.assert_close(result.shared.k, shared_k[:, len(COMMON) :], atol=ATOL, rtol=0)
    for (private, order, tail), sibling in zip(SIBLINGS, result.siblings, strict=True):
        prompt = COMMON + private + [t for i in order for t in SEGMENTS[i]] + tail
        k, v = _kv(executor, prompt)
        start = len(COMMON) + len(private)
        torch.testing.assert_close(sibling.recovered.k, k[:, start:], atol=ATOL, rtol=0)
        torch.testing.assert_close(sibling.recovered.v, v[:, start:], atol=ATOL, rtol=0)


def test_siblings_without_correction_store_no_diff_and_restore_exactly(tiny):
    executor, _ = tiny
    result = _round(executor, "kv_deviation", 0.2, 0.0)
    span = sum(LENGTHS)
    for sibling in result.siblings:
        assert len(sibling.mirror.diff_index) == 0
        k, v = restore(result.master, sibling.mirror, executor.config)
        assert torch.equal(k, sibling.recovered.k[:, :span])
        assert torch.equal(v, sibling.recovered.v[:, :span])
    # The shared work is counted once, not per sibling: its recompute plus each sibling's tail.
    tails = sum(len(tail) for _, _, tail in SIBLINGS)
    assert result.computed_tokens == result.shared.computed_tokens + tails


def test_corrected_blocks_become_the_exact_sparse_diff(tiny):
    executor, _ = tiny
    result = _round(executor, "kv_deviation", 0.2, 0.5)
    span = sum(LENGTHS)
    blocks = sum(-(-n // 4) for n in LENGTHS)
    for sibling in result.siblings:
        corrected = torch.unique(sibling.mirror.block_of_token()[sibling.recovered.recomputed])
        assert torch.equal(sibling.mirror.diff_index, corrected)
        assert 0 < len(corrected) < blocks
        k, v = restore(result.master, sibling.mirror, executor.config)
        assert kv_digest(k, v) == kv_digest(
            sibling.recovered.k[:, :span], sibling.recovered.v[:, :span]
        )
        assert sibling.mirror.nbytes < sibling.mirror.dense_nbytes()
