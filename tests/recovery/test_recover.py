"""Recovery on the tiny model, against full recomputation of the same prompt.

Tolerance 1e-4 as in tests/compute/test_executor_tiny.py: same fp32 math, different reduction
order (~1e-6 observed); a wrong mask, position or KV entry moves values by ~1e-1 here.
"""

from dataclasses import replace

import pytest
import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.recovery.policies import POLICIES
from kmesh.recovery.recover import RecoveryConfig, RegionInput, recover
from tests.conftest import random_tokens

ATOL = 1e-4
PREFIX, REGION = 12, 30


def _full(executor: Executor, tokens: list[int]):
    out = executor.forward([SequenceInput(torch.tensor(tokens), torch.arange(len(tokens)))])[0]
    return torch.stack(out.k), torch.stack(out.v), executor.logits(out.hidden[-1:])[0]


def _region(executor: Executor, tokens: list[int], reused: str, block: bool = False, keep=False):
    """The last REGION tokens as a region after an exact PREFIX; tokens 2..25 reusable with the
    exact KV (reused="exact") or garbage (reused="garbage"); the rest are new."""
    k, v, _ = _full(executor, tokens)
    prefix = DenseKV(torch.arange(PREFIX), list(k[:, :PREFIX]), list(v[:, :PREFIX]))
    reused_k, reused_v = k[:, PREFIX:].clone(), v[:, PREFIX:].clone()
    if reused == "garbage":
        gen = torch.Generator().manual_seed(3)
        reused_k = torch.randn(reused_k.shape, generator=gen)
        reused_v = torch.randn(reused_v.shape, generator=gen)
    reusable = torch.zeros(REGION, dtype=torch.bool)
    reusable[2:26] = True
    segment = torch.tensor([0] * 14 + [1] * 16)
    return RegionInput(
        torch.tensor(tokens[PREFIX:]),
        torch.arange(PREFIX, PREFIX + REGION),
        prefix,
        reused_k,
        reused_v,
        reusable,
        segment,
        torch.arange(REGION) // 4 if block else None,
        keep_reused_outside_selection=keep,
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_with_exact_reused_kv_every_policy_reproduces_full_prefill(tiny, policy, ratio):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=1)
    k, v, logits = _full(executor, tokens)
    out = recover(executor, [_region(executor, tokens, "exact")], RecoveryConfig(policy, ratio))[0]
    torch.testing.assert_close(out.k, k[:, PREFIX:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.v, v[:, PREFIX:], atol=ATOL, rtol=0)
    assert out.last_hidden is not None
    torch.testing.assert_close(executor.logits(out.last_hidden[None])[0], logits, atol=ATOL, rtol=0)


def test_full_policy_repairs_garbage_and_none_does_not(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=2)
    _, _, logits = _full(executor, tokens)
    region = _region(executor, tokens, "garbage")
    full, none = (recover(executor, [region], RecoveryConfig(p, 0.0))[0] for p in ("full", "none"))
    assert full.last_hidden is not None and none.last_hidden is not None
    torch.testing.assert_close(
        executor.logits(full.last_hidden[None])[0], logits, atol=ATOL, rtol=0
    )
    assert (executor.logits(none.last_hidden[None])[0] - logits).abs().max() > 1e-2
    assert full.computed_tokens == REGION
    assert none.computed_tokens == REGION - 24  # only the new tokens
    assert len(full.recomputed) == 24 and len(none.recomputed) == 0


def test_kv_deviation_cost_and_choice(tiny):
    executor, _ = tiny
    layers = executor.config.num_layers  # 2: check layer 1 is the last one
    tokens = random_tokens(PREFIX + REGION, seed=3)
    out = recover(
        executor, [_region(executor, tokens, "garbage")], RecoveryConfig("kv_deviation", 0.25)
    )[0]
    chosen = len(out.recomputed)
    assert chosen == round(0.25 * 24)
    later = layers - 2
    assert out.computed_tokens == pytest.approx(REGION * 2 / layers + (chosen + 6) * later / layers)
    assert out.deviation is not None and out.deviation > 0.5  # garbage deviates


def test_the_quality_gate_falls_back_to_full_recomputation(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=4)
    k, _, logits = _full(executor, tokens)
    gated = RecoveryConfig("first_k", 0.1, gate=0.5)
    bad = recover(executor, [_region(executor, tokens, "garbage")], gated)[0]
    assert bad.fell_back and len(bad.recomputed) == 24
    assert bad.last_hidden is not None
    torch.testing.assert_close(executor.logits(bad.last_hidden[None])[0], logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(bad.k, k[:, PREFIX:], atol=ATOL, rtol=0)
    good = recover(executor, [_region(executor, tokens, "exact")], gated)[0]
    assert not good.fell_back and good.deviation is not None and good.deviation < 1e-3
    assert len(good.recomputed) == round(0.1 * 24)


def test_a_sampled_gate_checks_a_share_of_the_reused_tokens_and_still_falls_back(tiny):
    executor, _ = tiny
    layers = executor.config.num_layers
    tokens = random_tokens(PREFIX + REGION, seed=4)
    k, v, logits = _full(executor, tokens)
    sampled = RecoveryConfig("none", 0.0, gate=0.5, gate_sample=0.25)
    good = recover(executor, [_region(executor, tokens, "exact")], sampled)[0]
    # 6 of the 24 reused tokens and the 6 new ones through the check layers 0..1, the new ones on
    assert good.computed_tokens == pytest.approx((6 + 6) * 2 / layers + 6 * (layers - 2) / layers)
    assert not good.fell_back and good.deviation is not None and good.deviation < 1e-3
    torch.testing.assert_close(good.k, k[:, PREFIX:], atol=ATOL, rtol=0)
    assert good.last_hidden is not None
    torch.testing.assert_close(
        executor.logits(good.last_hidden[None])[0], logits, atol=ATOL, rtol=0
    )
    bad = recover(executor, [_region(executor, tokens, "garbage")], sampled)[0]
    assert bad.fell_back and bad.deviation is not None and bad.deviation > 0.5
    torch.testing.assert_close(bad.k, k[:, PREFIX:], atol=ATOL, rtol=0)
    torch.testing.assert_close(bad.v, v[:, PREFIX:], atol=ATOL, rtol=0)


def test_a_sampled_gate_reads_at_most_the_cap_of_reused_tokens(tiny, monkeypatch):
    executor, _ = tiny
    layers = executor.config.num_layers
    tokens = random_tokens(PREFIX + REGION, seed=4)
    monkeypatch.setattr("kmesh.recovery.recover.GATE_SAMPLE_MAX", 4)
    sampled = RecoveryConfig("none", 0.0, gate=0.5, gate_sample=0.25)
    out = recover(executor, [_region(executor, tokens, "exact")], sampled)[0]
    # 4 of the 24 reused tokens (a share of 0.25 would be 6), and the 6 new ones
    assert out.computed_tokens == pytest.approx((4 + 6) * 2 / layers + 6 * (layers - 2) / layers)
    every = RecoveryConfig("none", 0.0, gate=0.5, gate_sample=1.0)
    out = recover(executor, [_region(executor, tokens, "exact")], every)[0]
    assert out.computed_tokens == pytest.approx((24 + 6) * 2 / layers + 6 * (layers - 2) / layers)


def test_a_sampled_gate_leaves_unchecked_reused_tokens_as_they_were(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=8)
    region = _region(executor, tokens, "garbage")
    out = recover(executor, [region], RecoveryConfig("none", 0.0, gate=None, gate_sample=0.25))[0]
    assert out.deviation is None  # no gate: nothing is checked
    gated = RecoveryConfig("none", 0.0, gate=10.0, gate_sample=0.25)
    out = recover(executor, [region], gated)[0]
    checked = torch.nonzero(region.reusable)[:, 0][torch.linspace(0, 23, 6).round().long()]
    unchecked = region.reusable.clone()
    unchecked[checked] = False
    assert torch.equal(out.k[:, unchecked], region.reused_k[:, unchecked])
    assert not torch.equal(out.k[:2, checked], region.reused_k[:2, checked])  # fresh at 0..1
    # kv_deviation with a budget scores every token: the sample share does not apply
    scored = recover(executor, [region], RecoveryConfig("kv_deviation", 0.25, gate_sample=0.25))[0]
    assert scored.computed_tokens == pytest.approx(
        recover(executor, [region], RecoveryConfig("kv_deviation", 0.25))[0].computed_tokens
    )


def test_block_granularity_recomputes_whole_blocks_and_keeps_the_rest(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=5)
    region = _region(executor, tokens, "garbage", block=True, keep=True)
    out = recover(executor, [region], RecoveryConfig("kv_deviation", 0.3))[0]
    blocks = torch.unique(torch.arange(REGION)[out.recomputed] // 4)
    assert region.block is not None
    in_blocks = torch.isin(region.block, blocks) & region.reusable
    assert torch.equal(out.recomputed, torch.nonzero(in_blocks)[:, 0])
    untouched = region.reusable & ~in_blocks
    assert torch.equal(out.k[:, untouched], region.reused_k[:, untouched])
    assert torch.equal(out.v[:, untouched], region.reused_v[:, untouched])


def test_a_batch_equals_each_region_alone(tiny):
    executor, _ = tiny
    regions = [_region(executor, random_tokens(PREFIX + REGION, seed=s), "garbage") for s in (6, 7)]
    cfg = RecoveryConfig("kv_deviation", 0.2)
    together = recover(executor, regions, cfg)
    for region, out in zip(regions, together, strict=True):
        alone = recover(executor, [region], cfg)[0]
        assert torch.equal(alone.recomputed, out.recomputed)
        torch.testing.assert_close(alone.k, out.k, atol=ATOL, rtol=0)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="check layer"):
        RecoveryConfig("kv_deviation", 0.1, check_layer=0)
    with pytest.raises(ValueError, match="ratio"):
        RecoveryConfig("first_k", 1.5)
    with pytest.raises(ValueError, match="sample share"):
        RecoveryConfig("none", 0.0, gate_sample=0.0)
    with pytest.raises(ValueError, match="unknown recovery policy"):
        RecoveryConfig("magic", 0.1)


def test_a_scratch_region_gets_its_result_in_its_own_tensors_as_a_copy_would(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=4)
    region = _region(executor, tokens, "garbage")
    cfg = RecoveryConfig("kv_deviation", 0.3)
    copied = recover(executor, [region], cfg)[0]
    scratch = replace(
        region, reused_k=region.reused_k.clone(), reused_v=region.reused_v.clone(), scratch=True
    )
    out = recover(executor, [scratch], cfg)[0]
    assert out.k is scratch.reused_k and out.v is scratch.reused_v
    assert torch.equal(out.k, copied.k) and torch.equal(out.v, copied.v)
    assert not torch.equal(region.reused_k, copied.k)  # a region that is not scratch is left alone


def _query_scores(executor: Executor, tokens: list[int], region: RegionInput) -> torch.Tensor:
    """[REGION] attention of the asking new tokens (the last 4: tokens 0 and 1 precede every
    reusable one) on each reusable token at layer 1, brute force from a full forward's queries
    and keys (exact reused KV: the region's first phase sees what the full forward sees)."""
    captured: dict[int, torch.Tensor] = {}
    out = executor.forward(
        [SequenceInput(torch.tensor(tokens), torch.arange(len(tokens)))],
        on_layer_input=lambda i, h: captured.setdefault(i, h),
    )[0]
    asking = torch.arange(PREFIX + 26, PREFIX + REGION)
    q, _ = executor.queries_keys(1, captured[1][asking], asking)
    keys = out.k[1][PREFIX:][region.reusable]
    group = q.shape[1] // keys.shape[1]
    logits = torch.einsum("nhd,mhd->nhm", q, keys.repeat_interleave(group, dim=1))
    weights = torch.softmax(logits * executor.config.attention_scale, dim=-1)
    scores = torch.zeros(REGION)
    scores[region.reusable] = weights.mean(dim=(0, 1))
    return scores


@pytest.mark.parametrize("block", [False, True])
def test_query_recomputes_the_units_the_new_tokens_attend_to_most(tiny, block):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=9)
    region = _region(executor, tokens, "exact", block=block)
    scores = _query_scores(executor, tokens, region)
    out = recover(executor, [region], RecoveryConfig("query", 0.25))[0]
    if region.block is None:
        expected = torch.sort(torch.topk(scores, 6).indices).values
    else:  # a block scores its tokens' sum: 7 blocks hold reusable tokens, 0.25 of them is 2
        sums = torch.zeros(REGION // 4 + 1).index_add(0, region.block, scores)
        top = torch.topk(sums, 2).indices
        expected = torch.nonzero(torch.isin(region.block, top) & region.reusable)[:, 0]
    assert torch.equal(out.recomputed, expected)
    # the new tokens through the check layers 0..1 to ask, then the chosen and new ones through all
    assert out.computed_tokens == pytest.approx(6 + len(expected) + 6)
    assert out.deviation is None  # no gate: nothing deviates


def test_query_recomputes_reused_tokens_the_new_ones_are_made_to_attend_to(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=10)
    region = _region(executor, tokens, "garbage")
    # The new tokens' first phase as recovery runs it: against the prefix and the reused KV
    new = ~region.reusable
    assert region.prefix is not None
    context = DenseKV(
        torch.cat((region.prefix.positions, region.positions[~new])),
        [torch.cat((region.prefix.k[i], region.reused_k[i, ~new])) for i in range(2)],
        [torch.cat((region.prefix.v[i], region.reused_v[i, ~new])) for i in range(2)],
    )
    captured: dict[int, torch.Tensor] = {}
    executor.forward(
        [SequenceInput(region.token_ids[new], region.positions[new], context)],
        on_layer_input=lambda i, h: captured.setdefault(i, h),
    )
    asking = torch.nonzero(new)[:, 0] >= 26  # tokens 0 and 1 precede every reusable one
    q, _ = executor.queries_keys(1, captured[1][asking], region.positions[new][asking])
    # Each kv head's key of tokens 5 and 17 along the sum of the queries that read it
    kv_heads = region.reused_k.shape[2]
    toward = q.view(len(q), kv_heads, -1, q.shape[-1]).sum(dim=(0, 2))
    for row in (5, 17):
        region.reused_k[1, row] = 20 * toward / toward.norm(dim=-1, keepdim=True)
    out = recover(executor, [region], RecoveryConfig("query", 2 / 24))[0]
    assert out.recomputed.tolist() == [5, 17]


def test_first_k_and_query_splits_the_budget(tiny):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=9)
    region = _region(executor, tokens, "exact")
    scores = _query_scores(executor, tokens, region)
    out = recover(executor, [region], RecoveryConfig("first_k+query", 0.25))[0]
    first = [2, 3, 14]  # segment 0's first reusable tokens 2 and 3 and segment 1's first, 14
    scores[first] = -1.0
    rest = torch.topk(scores, 3).indices.tolist()
    assert out.recomputed.tolist() == sorted(first + rest)


@pytest.mark.parametrize("policy", ["query", "first_k+query"])
def test_query_at_ratio_one_is_full_recomputation_and_at_zero_is_none(tiny, policy):
    executor, _ = tiny
    tokens = random_tokens(PREFIX + REGION, seed=2)
    region = _region(executor, tokens, "garbage")
    full = recover(executor, [region], RecoveryConfig("full", 0.0))[0]
    everything = recover(executor, [region], RecoveryConfig(policy, 1.0))[0]
    assert torch.equal(everything.recomputed, full.recomputed)
    torch.testing.assert_close(everything.k, full.k, atol=ATOL, rtol=0)
    torch.testing.assert_close(everything.v, full.v, atol=ATOL, rtol=0)
    assert everything.last_hidden is not None and full.last_hidden is not None
    torch.testing.assert_close(everything.last_hidden, full.last_hidden, atol=ATOL, rtol=0)
    none = recover(executor, [region], RecoveryConfig("none", 0.0))[0]
    nothing = recover(executor, [region], RecoveryConfig(policy, 0.0))[0]
    assert len(nothing.recomputed) == 0 and nothing.computed_tokens == none.computed_tokens
    assert torch.equal(nothing.k, none.k) and torch.equal(nothing.v, none.v)


def test_the_gate_still_falls_back_under_query(tiny):
    executor, _ = tiny
    layers = executor.config.num_layers
    tokens = random_tokens(PREFIX + REGION, seed=4)
    k, _, logits = _full(executor, tokens)
    gated = RecoveryConfig("query", 0.25, gate=0.5, gate_sample=0.25)
    bad = recover(executor, [_region(executor, tokens, "garbage")], gated)[0]
    assert bad.fell_back and len(bad.recomputed) == 24
    assert bad.last_hidden is not None
    torch.testing.assert_close(executor.logits(bad.last_hidden[None])[0], logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(bad.k, k[:, PREFIX:], atol=ATOL, rtol=0)
    good = recover(executor, [_region(executor, tokens, "exact")], gated)[0]
    assert not good.fell_back and good.deviation is not None and good.deviation < 1e-3
    assert len(good.recomputed) == 6
    # 6 sampled and the 6 new tokens through the check layers, then 6 chosen and 6 new through all
    assert good.computed_tokens == pytest.approx((6 + 6) * 2 / layers + (6 + 6))


@pytest.mark.parametrize("new", ["none", "only_before"])
@pytest.mark.parametrize("policy", ["query", "first_k+query"])
def test_a_region_where_no_new_token_asks_gets_first_k_s_choice(tiny, policy, new):
    executor, _ = tiny
    region = _region(executor, random_tokens(PREFIX + REGION, seed=5), "garbage")
    reusable = torch.ones(REGION, dtype=torch.bool)
    if new == "only_before":
        reusable[:2] = False  # tokens 0 and 1 precede every reusable token: they see none
    region = replace(region, reusable=reusable)
    out = recover(executor, [region], RecoveryConfig(policy, 0.3))[0]
    first_k = recover(executor, [region], RecoveryConfig("first_k", 0.3))[0]
    assert torch.equal(out.recomputed, first_k.recomputed)
    torch.testing.assert_close(out.k, first_k.k, atol=ATOL, rtol=0)
    assert out.computed_tokens == pytest.approx(first_k.computed_tokens)  # nothing was asked


def test_first_k_and_kv_deviation_pays_the_check_layer_for_every_token(tiny):
    executor, _ = tiny
    region = _region(executor, random_tokens(PREFIX + REGION, seed=3), "garbage")
    both = recover(executor, [region], RecoveryConfig("first_k+kv_deviation", 0.25))[0]
    alone = recover(executor, [region], RecoveryConfig("kv_deviation", 0.25))[0]
    assert both.computed_tokens == pytest.approx(alone.computed_tokens)
    assert {2, 3, 14} <= set(both.recomputed.tolist()) and len(both.recomputed) == 6
