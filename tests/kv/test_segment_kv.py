import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import SequenceInput
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.segment_kv import SegmentKV
from tests.conftest import random_tokens, rope_pair_norms

CONFIG = ModelConfig.from_hf(TINY_HF_CONFIG)


def test_kv_stored_at_canonical_positions_is_placed_where_it_would_be_computed(tiny):
    """A segment computed alone at offset 7 and placed at 40 equals it computed alone at 40:
    the first layer's keys depend on token and position only (later layers are context)."""
    executor, _ = tiny
    tokens = torch.tensor(random_tokens(10, seed=3))

    def keys_at(start: int) -> torch.Tensor:
        out = executor.forward([SequenceInput(tokens, torch.arange(start, start + 10))])[0]
        return torch.stack(out.k), torch.stack(out.v)

    k7, v7 = keys_at(7)
    k40, v40 = keys_at(40)
    stored = SegmentKV.canonical(k7, v7, torch.arange(7, 17), CONFIG)
    k, v = stored.placed(torch.arange(40, 50), CONFIG)
    torch.testing.assert_close(k[0], k40[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(v[0], v40[0], atol=1e-5, rtol=0)
    assert torch.equal(v, v7)
    assert len(stored) == 10


def test_bfloat16_segment_kv_stays_bfloat16_and_comes_back_within_two_roundings(tiny):
    """Stored in a bfloat16 cache's dtype, canonical then placed back at its positions: keys turned
    twice, each turn in float32 and rounded once (2^-8 of the pair norm each, the turn preserving
    norms), values untouched."""
    executor, _ = tiny
    tokens = torch.tensor(random_tokens(10, seed=5))
    positions = torch.arange(300, 310)
    out = executor.forward([SequenceInput(tokens, positions)])[0]
    k, v = torch.stack(out.k).bfloat16(), torch.stack(out.v).bfloat16()
    stored = SegmentKV.canonical(k, v, positions, CONFIG)
    assert stored.k.dtype == stored.v.dtype == torch.bfloat16
    placed_k, placed_v = stored.placed(positions, CONFIG)
    assert placed_k.dtype == torch.bfloat16 and torch.equal(placed_v, v)
    assert ((placed_k.float() - k.float()).abs() <= 2**-7 * 1.01 * rope_pair_norms(k)).all()
