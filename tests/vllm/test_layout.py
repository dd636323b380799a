"""Which of vLLM's KV cache groupings KMeshConnector takes (kmesh/vllm/layout.py): one group that
keeps every page, also when some of its layers attend through a sliding window (Gemma 3, whose
windowed layers vLLM allocates as full ones with the hybrid KV cache manager off); a group whose
pages vLLM frees outside the window, or several groups, are refused in one line.
tests/vllm/test_families_vllm.py starts vLLM on such models."""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from kmesh.vllm.layout import BlockLayout

NAMES = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)]
SHAPE = {"block_size": 32, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}


def layout(*groups: KVCacheGroupSpec) -> BlockLayout:
    return BlockLayout.of(SimpleNamespace(kv_cache_groups=list(groups)), 32, "cpu")


@pytest.mark.parametrize("window", [None, 16], ids=["full attention", "promoted windows"])
def test_one_group_of_full_attention_pages_is_taken_windowed_layers_included(window):
    got = layout(KVCacheGroupSpec(NAMES, FullAttentionSpec(**SHAPE, sliding_window=window)))
    assert got.layer_names == tuple(sorted(NAMES))
    assert got.page_bytes == FullAttentionSpec(**SHAPE).page_size_bytes


def test_a_group_whose_pages_vllm_frees_outside_the_window_is_refused():
    with pytest.raises(ValueError, match="KMeshConnector needs every KV page") as raised:
        layout(KVCacheGroupSpec(NAMES, SlidingWindowSpec(**SHAPE, sliding_window=16)))
    assert "sliding window (16 tokens" in str(raised.value) and "\n" not in str(raised.value)


def test_several_groups_are_refused():
    full = KVCacheGroupSpec(NAMES[:2], FullAttentionSpec(**SHAPE))
    window = KVCacheGroupSpec(NAMES[2:], SlidingWindowSpec(**SHAPE, sliding_window=16))
    with pytest.raises(ValueError, match=r"vLLM made 2 .*hybrid models are not supported"):
        layout(full, window)
