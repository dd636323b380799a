"""The executor's exactness restated for the half-precision KV caches a GPU engine runs (bfloat16,
float16): a suffix computed against its cached prefix equals one forward over the whole prompt,
within rounding of the dtype, with the same greedy tokens.

Tolerances: in float32 the two ways agree to float32 rounding (tests/compute/test_executor_tiny.py,
1e-5). In half precision the suffix's attention reduces over the cached prefix in another order,
so each logit may move by a few roundings of the dtype: measured on the tiny model, keys bit for
bit in both, logits 0 (bfloat16, the CPU computes its matmuls in float32) and 9.6e-4 of the
logits' max abs (float16). REL bounds that at 2^-6 (four bfloat16 roundings); a wrong row, mask or
position moves logits by about 1e-1 of their max abs.
"""

import pytest
import torch

from kmesh.compute.executor import DenseKV, SequenceInput
from kmesh.compute.tiny import tiny_executor

REL = 2**-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 64, 150])
def test_a_suffix_against_its_cached_prefix_equals_one_forward_in_half_precision(dtype, split):
    executor, _ = tiny_executor(dtype=dtype)
    ids = torch.randint(3, 200, (200,), generator=torch.Generator().manual_seed(1))
    whole = executor.forward([SequenceInput(ids, torch.arange(200))])[0]
    head = executor.forward([SequenceInput(ids[:split], torch.arange(split))])[0]
    cached = DenseKV(torch.arange(split), head.k, head.v)
    tail = executor.forward([SequenceInput(ids[split:], torch.arange(split, 200), cached)])[0]
    assert tail.k[0].dtype == dtype
    got, want = executor.logits(tail.hidden).float(), executor.logits(whole.hidden[split:]).float()
    assert (got - want).abs().max() <= REL * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for mine, full in zip(tail.k, whole.k, strict=True):
        scale = full.float().abs().max()
        assert (mine.float() - full[split:].float()).abs().max() <= REL * scale


def test_the_bound_catches_a_wrong_position():
    executor, _ = tiny_executor(dtype=torch.float16)
    ids = torch.randint(3, 200, (100,), generator=torch.Generator().manual_seed(1))
    whole = executor.forward([SequenceInput(ids, torch.arange(100))])[0]
    head = executor.forward([SequenceInput(ids[:50], torch.arange(50))])[0]
    cached = DenseKV(torch.arange(50), head.k, head.v)
    shifted = executor.forward([SequenceInput(ids[50:], torch.arange(51, 101), cached)])[0]
    got, want = executor.logits(shifted.hidden).float(), executor.logits(whole.hidden[50:]).float()
    assert (got - want).abs().max() > REL * want.abs().max()
