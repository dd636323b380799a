"""The subset primitive on a tiny random Llama, against recomputation of the same tokens.

NOTE on tolerance: the subset and the full computation run the same fp32 operations but with
different attention shapes, so sums are reduced in a different order. On these O(1)-magnitude
activations that moves results by ~1e-6; 1e-4 leaves room and still catches a wrong mask, position
or KV entry (those move logits by ~1e-1 here).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.tiny import TINY_HF_CONFIG, random_state_dict
from tests.conftest import random_tokens

ATOL = 1e-4


def full(executor: Executor, tokens: list[int]):
    out = executor.forward([SequenceInput(torch.tensor(tokens), torch.arange(len(tokens)))])[0]
    return out, executor.logits(out.hidden)


def test_matches_transformers_on_the_same_weights(tiny):
    executor, _ = tiny
    hf = LlamaForCausalLM(LlamaConfig(**TINY_HF_CONFIG)).eval()
    hf.load_state_dict(random_state_dict(seed=0), strict=False)
    hf.tie_weights()
    tokens = random_tokens(300, seed=1)
    _, ours = full(executor, tokens)
    with torch.inference_mode():
        reference = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("a", "b"), [(1, 2), (15, 16), (16, 17), (16, 48), (37, 38), (5, 90)])
def test_suffix_against_cached_prefix_equals_computing_all_at_once(tiny, a, b):
    executor, _ = tiny
    tokens = random_tokens(b, seed=a)
    reference, reference_logits = full(executor, tokens)
    prefix = executor.forward([SequenceInput(torch.tensor(tokens[:a]), torch.arange(a))])[0]
    suffix = executor.forward(
        [
            SequenceInput(
                torch.tensor(tokens[a:]), torch.arange(a, b), prefix.as_context(torch.arange(a))
            )
        ]
    )[0]
    torch.testing.assert_close(
        executor.logits(suffix.hidden), reference_logits[a:], atol=ATOL, rtol=0
    )
    for layer in range(executor.config.num_layers):
        torch.testing.assert_close(suffix.k[layer], reference.k[layer][a:], atol=ATOL, rtol=0)
        torch.testing.assert_close(suffix.v[layer], reference.v[layer][a:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_any_set_of_positions_against_exact_kv_of_the_others_equals_full(tiny, seed):
    executor, _ = tiny
    n = 64
    tokens = random_tokens(n, seed=100 + seed)
    reference, reference_logits = full(executor, tokens)
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(n, generator=gen)[: 1 + seed * 7].sort().values
    others = torch.tensor([p for p in range(n) if p not in set(chosen.tolist())])
    context = DenseKV(
        others,
        [k[others] for k in reference.k],
        [v[others] for v in reference.v],
    )
    out = executor.forward([SequenceInput(torch.tensor(tokens)[chosen], chosen, context)])[0]
    torch.testing.assert_close(
        executor.logits(out.hidden), reference_logits[chosen], atol=ATOL, rtol=0
    )
    for layer in range(executor.config.num_layers):
        torch.testing.assert_close(out.k[layer], reference.k[layer][chosen], atol=ATOL, rtol=0)


def test_inputs_out_of_position_order_are_causal_by_position(tiny):
    executor, _ = tiny
    tokens = random_tokens(20, seed=5)
    _, reference_logits = full(executor, tokens)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    out = executor.forward([SequenceInput(torch.tensor(tokens)[order], order)])[0]
    torch.testing.assert_close(
        executor.logits(out.hidden), reference_logits[order], atol=ATOL, rtol=0
    )


def test_a_batch_equals_each_sequence_alone(tiny):
    executor, _ = tiny
    seqs = [random_tokens(n, seed=n) for n in (3, 40, 17)]
    batch = executor.forward([SequenceInput(torch.tensor(t), torch.arange(len(t))) for t in seqs])
    for tokens, out in zip(seqs, batch, strict=True):
        _, alone = full(executor, tokens)
        torch.testing.assert_close(executor.logits(out.hidden), alone, atol=ATOL, rtol=0)


def test_a_wrong_context_position_changes_the_result(tiny):
    # Guards the tests above: they would pass vacuously if positions were ignored.
    executor, _ = tiny
    tokens = random_tokens(32, seed=9)
    reference, reference_logits = full(executor, tokens)
    shifted = DenseKV(
        torch.arange(16) + 3, [k[:16] for k in reference.k], [v[:16] for v in reference.v]
    )
    out = executor.forward(
        [SequenceInput(torch.tensor(tokens[16:]), torch.arange(16, 32), shifted)]
    )[0]
    assert (executor.logits(out.hidden) - reference_logits[16:]).abs().max() > 100 * ATOL


def test_sequences_sharing_a_prefix_attend_to_it_once_with_the_same_result(tiny):
    executor, _ = tiny
    trunk = random_tokens(40, seed=11)
    tails = [random_tokens(n, seed=20 + n) for n in (1, 6, 13)]
    prefix = full(executor, trunk)[0]
    shared = DenseKV(torch.arange(32), [k[:32] for k in prefix.k], [v[:32] for v in prefix.v])
    own = DenseKV(torch.arange(32, 40), [k[32:] for k in prefix.k], [v[32:] for v in prefix.v])
    batch = [
        SequenceInput(torch.tensor(tail), torch.arange(40, 40 + len(tail)), own, shared)
        for tail in tails
    ]
    for tail, out in zip(tails, executor.forward(batch), strict=True):
        _, reference = full(executor, trunk + tail)
        torch.testing.assert_close(executor.logits(out.hidden), reference[40:], atol=ATOL, rtol=0)


def test_a_shared_prefix_with_an_own_context_around_the_new_tokens_equals_full(tiny):
    """The own context before every new token is attended apart (no mask); one that lies
    between new tokens is masked by position: both equal the full computation."""
    executor, _ = tiny
    tokens = random_tokens(40, seed=12)
    reference, logits = full(executor, tokens)
    shared = DenseKV(torch.arange(32), [k[:32] for k in reference.k], [v[:32] for v in reference.v])
    for new in (torch.tensor([37, 38, 39]), torch.tensor([32, 35, 39])):
        kept = torch.tensor([p for p in range(32, 40) if p not in new.tolist()])
        own = DenseKV(kept, [k[kept] for k in reference.k], [v[kept] for v in reference.v])
        item = SequenceInput(torch.tensor(tokens)[new], new, own, shared)
        [out] = executor.forward([item])
        torch.testing.assert_close(executor.logits(out.hidden), logits[new], atol=ATOL, rtol=0)


def test_a_shared_context_after_the_new_tokens_is_refused(tiny):
    executor, _ = tiny
    prefix = full(executor, random_tokens(8, seed=1))[0]
    shared = prefix.as_context(torch.arange(8))
    with pytest.raises(ValueError, match="precede"):
        executor.forward([SequenceInput(torch.tensor([5]), torch.tensor([3]), None, shared)])


def test_a_run_split_across_layer_ranges_equals_one_run(tiny):
    executor, _ = tiny
    tokens = random_tokens(40, seed=7)
    item = SequenceInput(torch.tensor(tokens), torch.arange(40))
    reference, reference_logits = full(executor, tokens)
    first = executor.forward([item], layers=range(1))[0]
    assert len(first.k) == 1
    rest = executor.forward([item], layers=range(1, 2), residual=[first.residual])[0]
    assert torch.equal(first.k[0], reference.k[0]) and torch.equal(rest.k[0], reference.k[1])
    assert torch.equal(executor.logits(rest.hidden), reference_logits)


def test_a_partial_run_needs_the_residual_stream(tiny):
    executor, _ = tiny
    item = SequenceInput(torch.tensor([5, 6]), torch.arange(2))
    with pytest.raises(ValueError, match="residual"):
        executor.forward([item], layers=range(1, 2))
