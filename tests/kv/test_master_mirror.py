import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh.compute.config import ModelConfig
from kmesh.compute.rope import rerotate_keys
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror, kv_digest
from kmesh.kv.mirror_restore import restore

CONFIG = ModelConfig.from_hf(TINY_HF_CONFIG)
LAYERS, HEADS, DIM = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim


def make_segments(
    lengths: list[int], seed: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random segment KV, each computed at positions from a random offset."""
    gen = torch.Generator().manual_seed(seed)
    segments = []
    for n in lengths:
        k = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
        v = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
        offset = int(torch.randint(0, 60, (1,), generator=gen))
        segments.append(MasterSegment(k, v, offset + torch.arange(n)))
    return segments


def rotate_all_layers(k: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return rerotate_keys(k, source, target, CONFIG)


def overwrite(
    mirror: Mirror, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v with every token of sibling `blocks` replaced by random values."""
    gen = torch.Generator().manual_seed(seed)
    tokens = mirror.tokens_of_blocks(blocks)
    k, v = k.clone(), v.clone()
    k[:, tokens] = torch.randn(LAYERS, tokens.numel(), HEADS, DIM, generator=gen)
    v[:, tokens] = torch.randn(LAYERS, tokens.numel(), HEADS, DIM, generator=gen)
    return k, v


def index_bytes(mirror: Mirror) -> int:
    tensors = (mirror.block_table, mirror.diff_index, mirror.token_slots, mirror.positions)
    return sum(t.numel() * t.element_size() for t in tensors)


def block_bytes(block_size: int) -> int:
    return 2 * LAYERS * block_size * HEADS * DIM * 4


LENGTHS = [5, 16, 23]
ORDER = (2, 0, 1)


def test_restore_without_diff_is_the_segments_rotated_to_sibling_positions():
    segments = make_segments(LENGTHS, seed=0)
    master = Master.build(segments, 8, CONFIG)
    mirror = Mirror.of(master, ORDER, 37)
    k, v = restore(master, mirror, CONFIG)

    assert master.segment_first_block == (0, 1, 3)
    assert mirror.block_table.tolist() == [3, 4, 5, 0, 1, 2]
    assert mirror.positions.tolist() == list(range(37, 37 + sum(LENGTHS)))
    source_k = torch.cat([segments[i].k for i in ORDER], dim=1)
    source_v = torch.cat([segments[i].v for i in ORDER], dim=1)
    source_positions = torch.cat([segments[i].positions for i in ORDER])
    expected_k = rotate_all_layers(source_k, source_positions, mirror.positions)
    torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=0)
    assert torch.equal(v, source_v)


def test_block_and_token_maps_skip_the_padding():
    master = Master.build(make_segments(LENGTHS, seed=0), 8, CONFIG)
    mirror = Mirror.of(master, ORDER, 0)
    # Sibling blocks: segment 2 -> 0..2 (23 tokens), segment 0 -> 3 (5), segment 1 -> 4..5 (16).
    assert mirror.token_slots[:23].tolist() == list(range(23))
    assert mirror.token_slots[23:28].tolist() == list(range(24, 29))
    assert mirror.token_slots[28:].tolist() == list(range(32, 48))
    assert mirror.block_of_token()[21:30].tolist() == [2, 2, 3, 3, 3, 3, 3, 4, 4]
    assert mirror.tokens_of_blocks(torch.tensor([3, 0])).tolist() == [
        *range(8),
        *range(23, 28),
    ]


def test_exact_diff_restores_the_sibling_kv_bit_identically():
    master = Master.build(make_segments(LENGTHS, seed=1), 8, CONFIG)
    base = Mirror.of(master, ORDER, 37)
    k, v = restore(master, base, CONFIG)
    blocks = torch.tensor([4, 1])
    new_k, new_v = overwrite(base, k, v, blocks, seed=2)

    mirror = base.with_diff(master, new_k, new_v, blocks)
    restored_k, restored_v = restore(master, mirror, CONFIG)

    assert mirror.diff_index.tolist() == [1, 4]
    assert torch.equal(restored_k, new_k) and torch.equal(restored_v, new_v)
    assert kv_digest(restored_k, restored_v) == kv_digest(new_k, new_v)
    assert kv_digest(restored_k, restored_v) != kv_digest(k, v)


def test_an_empty_diff_costs_only_the_indices():
    master = Master.build(make_segments(LENGTHS, seed=1), 8, CONFIG)
    base = Mirror.of(master, ORDER, 37)
    k, v = restore(master, base, CONFIG)
    mirror = base.with_diff(master, k, v, torch.tensor([], dtype=torch.int64))
    assert mirror.diff_blocks.shape[0] == 0
    assert mirror.nbytes == index_bytes(mirror)
    restored_k, restored_v = restore(master, mirror, CONFIG)
    assert torch.equal(restored_k, k) and torch.equal(restored_v, v)


def test_tolerance_mode_drops_blocks_within_tolerance():
    master = Master.build(make_segments(LENGTHS, seed=3), 8, CONFIG)
    base = Mirror.of(master, ORDER, 37)
    k, v = restore(master, base, CONFIG)
    near, far = base.tokens_of_blocks(torch.tensor([0])), base.tokens_of_blocks(torch.tensor([5]))
    new_k, new_v = k.clone(), v.clone()
    new_k[:, near] += 1e-6
    new_v[:, near] += 1e-6
    new_v[:, far] += 1.0

    mirror = base.with_diff(master, new_k, new_v, torch.tensor([0, 5]), tolerance=1e-3)
    restored_k, restored_v = restore(master, mirror, CONFIG)

    assert mirror.diff_index.tolist() == [5]
    assert 5e-7 < mirror.dropped_error < 2e-6
    worst = max((restored_k - new_k).abs().max(), (restored_v - new_v).abs().max())
    assert 0 < worst <= mirror.dropped_error
    assert torch.equal(restored_v[:, far], new_v[:, far])


def test_exact_mode_records_no_dropped_error():
    master = Master.build(make_segments(LENGTHS, seed=3), 8, CONFIG)
    base = Mirror.of(master, ORDER, 37)
    k, v = restore(master, base, CONFIG)
    assert base.with_diff(master, k, v, torch.tensor([0, 2])).dropped_error == 0.0
    kept = base.with_diff(master, k, v, torch.tensor([0, 2]), tolerance=0.0)
    assert kept.diff_index.numel() == 0 and kept.dropped_error == 0.0


def test_storage_accounting_and_savings_over_dense_copies():
    master = Master.build(make_segments(LENGTHS, seed=4), 8, CONFIG)
    per_block = block_bytes(8)
    assert master.nbytes == master.blocks.numel() * 4 == 6 * per_block

    siblings = 8
    mirrors = []
    for i in range(siblings):
        base = Mirror.of(master, ORDER[i % 3 :] + ORDER[: i % 3], 40 + 7 * i)
        k, v = restore(master, base, CONFIG)
        block = torch.tensor([i % 6])
        mirrors.append(base.with_diff(master, *overwrite(base, k, v, block, seed=i), block))

    for mirror in mirrors:
        assert mirror.dense_nbytes() == 6 * per_block
        assert mirror.nbytes == 1 * per_block + index_bytes(mirror)
    # 6 blocks x 4096 B dense per sibling; shared: master / 8 + 1 diff block + 760 B of indices.
    per_sibling = (master.nbytes + sum(m.nbytes for m in mirrors)) / siblings
    assert per_sibling == 6 * per_block / siblings + per_block + 760
    assert per_sibling < mirrors[0].dense_nbytes() / 3


def test_order_must_be_a_permutation():
    master = Master.build(make_segments(LENGTHS, seed=5), 8, CONFIG)
    for order in [(0, 0, 1), (0, 1), (0, 1, 3)]:
        with pytest.raises(ValueError, match="not a permutation"):
            Mirror.of(master, order, 0)


def test_shape_and_range_errors_name_the_problem():
    segments = make_segments(LENGTHS, seed=5)
    k, v, positions = segments[0].k, segments[0].v, segments[0].positions
    with pytest.raises(ValueError, match="segment 0: k has shape"):
        Master.build([MasterSegment(k[:, :, :1], v, positions)], 8, CONFIG)
    with pytest.raises(ValueError, match="segment 0: positions shape"):
        Master.build([MasterSegment(k, v, positions[:-1])], 8, CONFIG)

    master = Master.build(segments, 8, CONFIG)
    mirror = Mirror.of(master, ORDER, 0)
    rk, rv = restore(master, mirror, CONFIG)
    with pytest.raises(ValueError, match=r"k has shape .* expected the region's"):
        mirror.with_diff(master, rk[:, 1:], rv, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"v has shape .* expected the region's"):
        mirror.with_diff(master, rk, rv[:1], torch.tensor([0]))
    with pytest.raises(ValueError, match="block index out of range"):
        mirror.with_diff(master, rk, rv, torch.tensor([6]))
    with pytest.raises(ValueError, match="block index out of range"):
        mirror.tokens_of_blocks(torch.tensor([-1]))
    other = ModelConfig.from_hf({**TINY_HF_CONFIG, "rope_theta": 500000.0})
    with pytest.raises(ValueError, match="RoPE tables"):
        restore(master, mirror, other)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    block_size=st.sampled_from([4, 8, 16]),
    start=st.integers(0, 300),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_exact_restore_is_bit_identical_for_any_layout(
    lengths: list[int], block_size: int, start: int, seed: int, data: st.DataObject
):
    master = Master.build(make_segments(lengths, seed), block_size, CONFIG)
    order = data.draw(st.permutations(range(len(lengths))))
    base = Mirror.of(master, order, start)
    count = base.block_table.numel()
    assert count == sum(-(-n // block_size) for n in lengths)
    chosen = data.draw(st.sets(st.integers(0, count - 1)))
    blocks = torch.tensor(sorted(chosen), dtype=torch.int64)

    k, v = restore(master, base, CONFIG)
    new_k, new_v = overwrite(base, k, v, blocks, seed)
    mirror = base.with_diff(master, new_k, new_v, blocks)
    restored_k, restored_v = restore(master, mirror, CONFIG)

    assert torch.equal(restored_k, new_k) and torch.equal(restored_v, new_v)
    assert mirror.nbytes == len(chosen) * block_bytes(block_size) + index_bytes(mirror)


def test_the_digest_of_rows_is_their_contiguous_bytes_whatever_their_strides():
    whole = torch.randn(3, 10, 2, 4)
    k, v = whole[:, 2:7], whole[:, 5:9] * 2  # views across layers: not contiguous
    expected = blake3.blake3(k.contiguous().numpy().tobytes() + v.contiguous().numpy().tobytes())
    assert not k.is_contiguous() and kv_digest(k, v) == expected.hexdigest()
    assert kv_digest(k, v) != kv_digest(v, k)
    # Rows big enough for the digest's threads (MiBs a layer) digest to the one-thread hash.
    big = torch.randn(2, 8192, 3, 64)
    one = blake3.blake3(big.numpy().tobytes() + big.numpy().tobytes(), max_threads=1)
    assert kv_digest(big, big) == one.hexdigest()
