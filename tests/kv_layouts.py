"""vLLM 0.32's KV cache layouts as torch views, for tests that run without vLLM (tests/test_cuda.py
on a lent GPU). LAYOUTS are KVCacheLayout's stride permutations over [layer, block, head, token,
content]; tests/vllm/test_split_pages.py checks them, and the views made here, against vLLM's own
(KVCacheLayout, create_kv_cache_views) where vLLM is installed."""

import torch

LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layer_view_order(layout: str) -> tuple[int, ...]:
    """KVCacheLayout.layer_view_order: the memory order of a layer's [block, head, token,
    content] axes."""
    return tuple(axis - 1 for axis in LAYOUTS[layout] if axis != 0)


def layer_views(
    layout: str,
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """One zeroed allocation of logical `shape` [layers, blocks, heads, block_size, 2 * head]
    laid out in `layout`'s memory order, as one [blocks, heads, block_size, content] view per
    layer."""
    order = LAYOUTS[layout]
    raw = torch.zeros(tuple(shape[axis] for axis in order), dtype=dtype, device=device)
    logical = raw.permute(tuple(order.index(axis) for axis in range(5)))
    return list(logical.unbind(0))
