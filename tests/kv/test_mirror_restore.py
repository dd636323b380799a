import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh.compute.config import ModelConfig
from kmesh.compute.rope import apply_rope, inverse_frequencies, rerotate_keys, rope_cos_sin
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror
from kmesh.kv.mirror_restore import _runs, restore, restore_into

CONFIG = ModelConfig.from_hf(TINY_HF_CONFIG)
LAYERS, HEADS, DIM = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim


def master_of(lengths: list[int], block_size: int, dtype: torch.dtype, seed: int) -> Master:
    gen = torch.Generator().manual_seed(seed)
    segments, position = [], int(torch.randint(0, 50, (1,), generator=gen))
    for n in lengths:
        k = torch.randn(LAYERS, n, HEADS, DIM, generator=gen).to(dtype)
        k[:, :, :, 0] = -0.0  # a turn must keep what apply_rope keeps, signs of zeros included
        v = torch.randn(LAYERS, n, HEADS, DIM, generator=gen).to(dtype)
        segments.append(MasterSegment(k, v, position + torch.arange(n)))
        position += n + int(torch.randint(0, 9, (1,), generator=gen))
    return Master.build(segments, block_size, CONFIG)


def token_by_token(master: Master, mirror: Mirror) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every token's master row gathered and turned by its own angle, then the
    diff's rows."""
    bs = master.block_size
    block = mirror.block_table[mirror.token_slots // bs]
    within = mirror.token_slots % bs
    stored = master.block_positions[block] + within
    kv = master.blocks.permute(1, 2, 0, 3, 4, 5)  # [2, L, B, bs, H, D]
    inv_freq = inverse_frequencies(CONFIG.layers[0].rope)
    cos, sin = rope_cos_sin(mirror.positions - stored, inv_freq)
    k = apply_rope(kv[0][:, block, within], cos, sin)
    v = kv[1][:, block, within].clone()
    for index, sibling_block in enumerate(mirror.diff_index.tolist()):
        rows = (mirror.token_slots // bs == sibling_block).nonzero().flatten()
        k[:, rows] = mirror.diff_blocks[index, 0][:, within[rows]]
        v[:, rows] = mirror.diff_blocks[index, 1][:, within[rows]]
    return k, v


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    block_size=st.sampled_from([4, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    start=st.integers(0, 300),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_restore_gives_the_bits_of_turning_each_gathered_key_by_its_own_angle(
    lengths: list[int],
    block_size: int,
    dtype: torch.dtype,
    start: int,
    seed: int,
    data: st.DataObject,
):
    master = master_of(lengths, block_size, dtype, seed)
    mirror = Mirror.of(master, data.draw(st.permutations(range(len(lengths)))), start)
    chosen = data.draw(st.sets(st.integers(0, mirror.block_table.numel() - 1)))
    if chosen:
        k, v = restore(master, mirror, CONFIG)
        gen = torch.Generator().manual_seed(seed)
        k2 = torch.randn(k.shape, generator=gen).to(dtype)
        mirror = mirror.with_diff(master, k2, v, torch.tensor(sorted(chosen)))

    k, v = restore(master, mirror, CONFIG)
    expected_k, expected_v = token_by_token(master, mirror)

    assert same_bits(k, expected_k) and same_bits(v, expected_v)


def test_restore_into_writes_the_rows_of_a_view_and_nothing_around_them():
    master = master_of([5, 16, 23], 8, torch.float32, seed=1)
    mirror = Mirror.of(master, (2, 0, 1), 100)
    region_k = torch.full((LAYERS, 60, HEADS, DIM), float("nan"))
    region_v = torch.full((LAYERS, 60, HEADS, DIM), float("nan"))

    restore_into(master, mirror, CONFIG, region_k[:, 7:51], region_v[:, 7:51])

    k, v = restore(master, mirror, CONFIG)
    assert torch.equal(region_k[:, 7:51], k) and torch.equal(region_v[:, 7:51], v)
    outside = (region_k[:, :7], region_k[:, 51:], region_v[:, :7], region_v[:, 51:])
    assert all(rows.isnan().all() for rows in outside)


def run_lengths(master: Master, order: tuple[int, ...], start: int) -> list[int]:
    bs = master.block_size
    mirror = Mirror.of(master, order, start)
    slots = mirror.block_table[mirror.token_slots // bs] * bs + mirror.token_slots % bs
    stored = master.block_positions[slots // bs] + slots % bs
    return [count for _, _, count, _ in _runs(slots, mirror.positions - stored)]


def test_a_run_is_as_long_as_its_segments_read_consecutive_slots_at_one_turn():
    def segment(n: int, at: int) -> MasterSegment:
        return MasterSegment(
            torch.ones(LAYERS, n, HEADS, DIM),
            torch.ones(LAYERS, n, HEADS, DIM),
            at + torch.arange(n),
        )

    whole = Master.build([segment(16, 10), segment(16, 26), segment(16, 42)], 8, CONFIG)
    assert run_lengths(whole, (0, 1, 2), 10) == [48]  # where they were computed: one run
    assert run_lengths(whole, (0, 1, 2), 500) == [48]  # moved together: one turn
    assert run_lengths(whole, (2, 0, 1), 0) == [16, 32]  # 0 then 1 still follow each other
    padded = Master.build([segment(5, 10), segment(7, 15)], 8, CONFIG)
    assert run_lengths(padded, (0, 1), 10) == [5, 7]  # the padding between them breaks the run


def test_a_mirror_of_another_master_is_refused():
    master = master_of([5, 9], 8, torch.float32, seed=3)
    mirror = Mirror.of(master, (1, 0), 0)
    other = ModelConfig.from_hf({**TINY_HF_CONFIG, "rope_theta": 500000.0})
    with pytest.raises(ValueError, match="RoPE tables"):
        restore(master, mirror, other)


def test_each_layer_is_turned_by_its_own_rope_table():
    """Gemma 3's local and global layers have different thetas: a restore turns each layer's
    keys by its own table, the bits rerotate_keys gives every gathered key."""
    two_tables = ModelConfig.from_hf(
        {
            **TINY_HF_CONFIG,
            "model_type": "gemma3_text",
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        }
    )
    assert len(two_tables.rope_tables) == 2
    gen = torch.Generator().manual_seed(5)
    segments = [
        MasterSegment(
            torch.randn(LAYERS, n, HEADS, DIM, generator=gen),
            torch.randn(LAYERS, n, HEADS, DIM, generator=gen),
            at + torch.arange(n),
        )
        for n, at in ((11, 3), (20, 14))
    ]
    master = Master.build(segments, 8, two_tables)
    mirror = Mirror.of(master, (1, 0), 250)
    bs = master.block_size
    block = mirror.block_table[mirror.token_slots // bs]
    within = mirror.token_slots % bs
    stored = master.block_positions[block] + within
    gathered = master.blocks[:, 0].permute(1, 0, 2, 3, 4)[:, block, within]
    k, _ = restore(master, mirror, two_tables)
    assert same_bits(k, rerotate_keys(gathered, stored, mirror.positions, two_tables))
    one_table = rerotate_keys(gathered, stored, mirror.positions, CONFIG)  # both layers local
    assert torch.equal(one_table[0], k[0]) and not torch.equal(one_table[1], k[1])
    with pytest.raises(ValueError, match="RoPE tables"):
        restore(master, mirror, CONFIG)
