import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import SequenceInput
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.segment_kv import SegmentKV
from tests.conftest import random_tokens

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
