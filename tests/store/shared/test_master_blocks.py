"""Masters read block by block (kmesh/store/shared/master_blocks.py): a member reads only the master
blocks its mirrors take, a second member on the same engine only those the first did not read,
and the rows restored are the published ones bit for bit."""

import pytest
import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror
from kmesh.kv.mirror_restore import restore
from kmesh.recovery.jobs import RoundKey
from kmesh.store import TenantClients
from kmesh.store.errors import StoreError
from kmesh.store.shared.group_state import Piece, master_payload, restore_piece
from kmesh.store.shared.master_blocks import ReadMasters, blocks_read_by, read_master_blocks
from kmesh.store.shared.masters import StoreMasters
from kmesh.store.tensors import tensor_bytes

CONFIG = ModelConfig.from_hf(TINY_HF_CONFIG)
SALT = "kmesh-approx:t"
ROW_BYTES = 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * 4  # K and V, float32


def _master() -> Master:
    """Segments of 24 and 17 rows in blocks of 8: blocks 0-2 and 3-5 (block 5: one row)."""
    gen = torch.Generator().manual_seed(3)
    segments = []
    for n, start in ((24, 100), (17, 124)):
        shape = (CONFIG.num_layers, n, CONFIG.num_kv_heads, CONFIG.head_dim)
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        segments.append(MasterSegment(k, v, torch.arange(start, start + n)))
    return Master.build(segments, 8, CONFIG)


def _entry(master: Master) -> tuple[memoryview, int]:
    _, tensors, header = master_payload(master)
    return memoryview(b"".join([header, *tensor_bytes(tensors)])), len(header)


def test_only_the_blocks_asked_for_are_read_and_counted():
    master = _master()
    data, header = _entry(master)
    got, nbytes = read_master_blocks(data, CONFIG, {1, 5}, None)
    assert nbytes == header + (8 + 1) * ROW_BYTES
    assert torch.equal(got.blocks[[1, 5]], master.blocks[[1, 5]])
    assert not got.blocks[[0, 2, 3, 4]].any()
    # Into the master read before: the rest, and the whole master bit for bit.
    got, nbytes = read_master_blocks(data, CONFIG, {0, 2, 3, 4}, got)
    assert nbytes == header + 4 * 8 * ROW_BYTES
    assert torch.equal(got.blocks, master.blocks)


def test_a_block_the_entry_lacks_or_another_masters_shape_is_refused():
    master = _master()
    data, _ = _entry(master)
    with pytest.raises(StoreError, match="no block 6"):
        read_master_blocks(data, CONFIG, {6}, None)
    other = Master.build(master.segments()[:1], 8, CONFIG)
    with pytest.raises(StoreError, match="not shaped like"):
        read_master_blocks(data, CONFIG, {0}, other)


def _member(master: Master, changed_block: int) -> tuple[torch.Tensor, torch.Tensor, Mirror]:
    """A member's rows at 30.. mirrored from `master`, its sibling block `changed_block`
    recomputed (its rows differ from the master's: they are the mirror's diff), and the mirror."""
    mirror = Mirror.of(master, (0, 1), 30)
    k, v = restore(master, mirror, CONFIG)
    changed = mirror.token_slots // master.block_size == changed_block
    k[:, changed] += 1
    return k, v, mirror.with_diff(master, k, v, torch.tensor([changed_block]))


def test_members_read_the_master_blocks_their_diffs_do_not_replace_each_once(store):
    master = _master()
    masters = StoreMasters(TenantClients(store.socket), "f" * 64, CONFIG)
    round_key, tokens = RoundKey(SALT, "council", "r1"), tuple(range(41))
    masters.put(round_key, "sibling", tokens, master)
    key = masters.key(round_key, "sibling", tokens)
    _, header = _entry(master)
    read = ReadMasters(CONFIG)
    with store.client(tenant=SALT) as client:
        # Member 1 recomputed its block 1: it reads blocks 0 and 2-5 (8 + 8 + 8 + 8 + 1 rows).
        k, v, mirror = _member(master, 1)
        first = Piece.of(30, k, v, [mirror], key)
        assert blocks_read_by(first) == {0, 2, 3, 4, 5}
        got, nbytes = read.for_piece(client, first)
        assert nbytes == header + 33 * ROW_BYTES
        k_back, v_back = restore_piece(first, got, CONFIG)  # checked against its digest
        assert torch.equal(k_back, k) and torch.equal(v_back, v)
        # Member 2, on the same engine, recomputed its block 4: only block 1 is new to it.
        k, v, mirror = _member(master, 4)
        second = Piece.of(30, k, v, [mirror], key)
        got, nbytes = read.for_piece(client, second)
        assert nbytes == header + 8 * ROW_BYTES
        assert torch.equal(got.blocks, master.blocks)
        assert torch.equal(restore_piece(second, got, CONFIG)[0], k)
        # Both again: nothing is read.
        assert read.for_piece(client, first)[1] == read.for_piece(client, second)[1] == 0


def test_a_masters_key_tells_every_field_apart():
    """Family "a/b", round "c" and family "a", round "b/c" (and every other field) key apart."""
    masters = StoreMasters(TenantClients("unused.sock"), "f" * 64, CONFIG)
    tokens = tuple(range(8))
    keys = {
        masters.key(RoundKey(SALT, "a/b", "c"), "sibling", tokens),
        masters.key(RoundKey(SALT, "a", "b/c"), "sibling", tokens),
        masters.key(RoundKey(SALT, "a", "b/c"), "common", tokens),
        masters.key(RoundKey("other-tenant", "a", "b/c"), "sibling", tokens),
        masters.key(RoundKey(SALT, "a", "b/c"), "sibling", tokens[:-1]),
    }
    assert len(keys) == 5
