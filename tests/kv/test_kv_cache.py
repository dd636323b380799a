import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.kv_cache import PagedContext, PagedKVCache


def make_cache() -> PagedKVCache:
    return PagedKVCache(ModelConfig.from_hf(TINY_HF_CONFIG), 8, 4, torch.float32)


def test_slots_follow_the_block_table():
    cache = make_cache()
    assert cache.slots([5, 2], 2, 7).tolist() == [22, 23, 8, 9, 10]


def test_paged_context_reads_back_what_was_written_in_token_order():
    cache = make_cache()
    table = [6, 1, 3]
    k = torch.randn(10, 2, 16)
    v = torch.randn(10, 2, 16)
    cache.write(1, cache.slots(table, 0, 10), k, v)
    context = PagedContext(cache, table, 2, 7)
    read_k, read_v = context.layer(1)
    assert torch.equal(read_k, k[2:7]) and torch.equal(read_v, v[2:7])
    assert context.positions.tolist() == list(range(2, 7))
