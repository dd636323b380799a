"""vLLM's CPU paged KV layout (kmesh/vllm/pages.py): rows written with vLLM's own cache-write op
read back as they were written, and land where vLLM's layout puts them."""

from types import SimpleNamespace

import torch

from kmesh.vllm.pages import Pages

BLOCK, HEADS, DIM, BLOCKS, LAYERS = 128, 3, 64, 4, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
ATTENTION = {name: SimpleNamespace(isa="vec") for name in NAMES}


def pages() -> Pages:
    # vLLM's allocation per layer: [blocks, kv heads, block size, 2 * head size] (as registered).
    layers = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in NAMES]
    return Pages(layers, NAMES, BLOCK)


def test_rows_written_by_vllms_op_read_back_unchanged():
    paged = pages()
    block_ids = [2, 0, 3]  # a request's block table
    positions = torch.tensor([0, 1, 127, 128, 200, 300, 383])
    k = torch.randn(LAYERS, len(positions), HEADS, DIM)
    v = torch.randn(LAYERS, len(positions), HEADS, DIM)
    paged.write(block_ids, positions, k, v, ATTENTION)
    got_k, got_v = paged.read(block_ids, positions)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    untouched = torch.tensor([2, 129, 382])
    zero_k, zero_v = paged.read(block_ids, untouched)
    assert not zero_k.any() and not zero_v.any()


def test_keys_sit_transposed_in_the_first_half_of_a_page_and_values_in_the_second():
    paged = pages()
    k = torch.randn(LAYERS, 1, HEADS, DIM)
    v = torch.randn(LAYERS, 1, HEADS, DIM)
    paged.write([1], torch.tensor([5]), k, v, ATTENTION)
    page = paged.layers[0][1].reshape(HEADS, 2 * BLOCK, DIM)  # one block's page
    keys = page[:, :BLOCK].reshape(HEADS, DIM, BLOCK)  # [head, dim, slot]
    assert torch.equal(keys[:, :, 5], k[0, 0])
    assert torch.equal(page[:, BLOCK + 5], v[0, 0])
