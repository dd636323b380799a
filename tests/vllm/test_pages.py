"""vLLM's CPU paged KV layout (kmesh/vllm/cpu_pages.py): rows written with vLLM's own cache-write op
read back as they were written, in the cache's dtype (float32 or bfloat16), and land where vLLM's
layout puts them."""

import pytest
import torch

from kmesh.vllm.cpu_pages import CpuPages
from tests.vllm.helpers import cpu_attention

BLOCK, HEADS, DIM, BLOCKS, LAYERS = 128, 3, 64, 4, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def pages(dtype: torch.dtype = torch.float32) -> CpuPages:
    # vLLM's allocation per layer: [blocks, kv heads, block size, 2 * head size] (as registered).
    layers = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype) for _ in NAMES]
    return CpuPages(layers, BLOCK, list(cpu_attention(NAMES).values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_by_vllms_op_read_back_unchanged(dtype):
    paged = pages(dtype)
    block_ids = [2, 0, 3]  # a request's block table
    positions = torch.tensor([0, 1, 127, 128, 200, 300, 383])
    k = torch.randn(LAYERS, len(positions), HEADS, DIM).to(dtype)
    v = torch.randn(LAYERS, len(positions), HEADS, DIM).to(dtype)
    paged.write(block_ids, positions, k, v)
    got_k, got_v = paged.read(block_ids, positions)
    assert got_k.dtype == got_v.dtype == dtype
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    untouched = torch.tensor([2, 129, 382])
    zero_k, zero_v = paged.read(block_ids, untouched)
    assert not zero_k.any() and not zero_v.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_rows_read_a_page_at_a_time_are_the_rows_read_one_by_one(dtype):
    paged = pages(dtype)
    block_ids = [3, 1, 2]
    positions = torch.arange(100, 330)  # from inside the first page to inside the third
    k = torch.randn(LAYERS, len(positions), HEADS, DIM).to(dtype)
    v = torch.randn(LAYERS, len(positions), HEADS, DIM).to(dtype)
    paged.write(block_ids, positions, k, v)

    got_k, got_v = paged.read(block_ids, positions)
    back_k, back_v = paged.read(block_ids, positions.flip(0))  # not consecutive: row by row

    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.equal(back_k.flip(1), k) and torch.equal(back_v.flip(1), v)


def test_keys_sit_transposed_in_the_first_half_of_a_page_and_values_in_the_second():
    paged = pages()
    k = torch.randn(LAYERS, 1, HEADS, DIM)
    v = torch.randn(LAYERS, 1, HEADS, DIM)
    paged.write([1], torch.tensor([5]), k, v)
    page = paged.layers[0][1].reshape(HEADS, 2 * BLOCK, DIM)  # one block's page
    keys = page[:, :BLOCK].reshape(HEADS, DIM, BLOCK)  # [head, dim, slot]
    assert torch.equal(keys[:, :, 5], k[0, 0])
    assert torch.equal(page[:, BLOCK + 5], v[0, 0])


def test_float32_rows_land_in_bfloat16_pages_rounded_and_the_pages_stay_bfloat16():
    paged = pages(torch.bfloat16)
    layers = list(paged.layers)
    positions = torch.tensor([3, 130])
    k = torch.randn(LAYERS, 2, HEADS, DIM)
    v = torch.randn(LAYERS, 2, HEADS, DIM)
    paged.write([1, 2], positions, k, v)
    got_k, got_v = paged.read([1, 2], positions)
    assert torch.equal(got_k, k.bfloat16()) and torch.equal(got_v, v.bfloat16())
    assert all(
        a is b and a.dtype == torch.bfloat16 for a, b in zip(paged.layers, layers, strict=True)
    )
