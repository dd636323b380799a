import pytest
import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror
from kmesh.kv.mirror_restore import restore
from kmesh.state.keys import KeyNamespace, piece_key
from kmesh.store import EntryLost, StoreError
from kmesh.store.shared.group_state import (
    Piece,
    PieceMismatch,
    master_payload,
    piece_payload,
    publish,
    read_master,
    read_piece,
    restore_piece,
)
from kmesh.store.tensors import tensor_bytes
from tests.store.helpers import corrupt_segment

CONFIG = ModelConfig.from_hf(TINY_HF_CONFIG)
LAYERS, HEADS, DIM = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim
NAMESPACE = KeyNamespace("f" * 64, tenant_salt="kmesh-approx")


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(LAYERS, n, HEADS, DIM, generator=gen),
        torch.randn(LAYERS, n, HEADS, DIM, generator=gen),
    )


def _master(lengths: list[int]) -> Master:
    segments = []
    start = 40
    for i, n in enumerate(lengths):
        k, v = _rows(n, seed=i)
        segments.append(MasterSegment(k, v, torch.arange(start, start + n)))
        start += n
    return Master.build(segments, 8, CONFIG)


def _member_piece(master: Master, start: int, private: int) -> Piece:
    """A member's rows: `private` dense rows, then the master's segments in its order from
    start + private, with one recomputed block stored in the diff."""
    mirror = Mirror.of(master, (2, 0, 1), start + private)
    k, v = restore(master, mirror, CONFIG)
    gen = torch.Generator().manual_seed(9)
    tokens = mirror.tokens_of_blocks(torch.tensor([1]))
    k[:, tokens] = torch.randn(LAYERS, tokens.numel(), HEADS, DIM, generator=gen)
    mirror = mirror.with_diff(master, k, v, torch.tensor([1]))
    pk, pv = _rows(private, seed=7)
    rows_k, rows_v = torch.cat((pk, k), dim=1), torch.cat((pv, v), dim=1)
    return Piece.of(start, rows_k, rows_v, [mirror], b"m" * 32)


def test_a_piece_restores_its_rows_bit_identically_and_holds_only_its_diff_and_private_rows():
    master = _master([5, 16, 23])
    piece = _member_piece(master, start=100, private=6)
    k, _ = restore_piece(piece, master, CONFIG)
    assert k.shape == (LAYERS, 6 + 44, HEADS, DIM)
    dense_bytes = 2 * k.numel() * 4
    assert piece.nbytes < dense_bytes / 2  # one diff block and six rows, not 50 rows
    assert piece.dense_positions.tolist() == list(range(100, 106))


def test_a_piece_refuses_to_restore_against_another_master():
    master = _master([5, 16, 23])
    piece = _member_piece(master, start=100, private=6)
    other = Master(master.blocks + 1, *master_fields(master))
    with pytest.raises(PieceMismatch, match="not the rows"):
        restore_piece(piece, other, CONFIG)
    with pytest.raises(PieceMismatch, match="need their master"):
        restore_piece(piece, None, CONFIG)


def test_a_master_entry_holds_its_rows_without_the_blocks_padding_and_reads_back_whole():
    master = _master([5, 16, 23])  # blocks of 8: 3 + 5 + 1 padding rows
    size, tensors, header = master_payload(master)
    row_bytes = 2 * LAYERS * HEADS * DIM * 4
    assert size == len(header) + (5 + 16 + 23) * row_bytes < master.nbytes
    data = memoryview(b"".join([header, *tensor_bytes(tensors)]))
    assert data.nbytes == size
    read = read_master(data, CONFIG)
    assert torch.equal(read.blocks, master.blocks)
    assert master_fields(read) == master_fields(master)


def master_fields(master: Master) -> tuple:
    return (
        master.segment_lengths,
        master.segment_first_block,
        master.segment_starts,
        master.block_size,
        master.config,
    )


def test_masters_and_pieces_round_trip_through_the_store_and_a_corrupted_one_is_dropped(
    store_factory,
):
    store = store_factory(capacity="4M")
    master = _master([5, 16, 23])
    piece = _member_piece(master, start=100, private=6)
    dense = Piece.of(0, *_rows(30, seed=3))
    master_key = piece_key(NAMESPACE, None, [1, 2, 3])
    keys = [piece_key(NAMESPACE, master_key, [4]), piece_key(NAMESPACE, None, [5])]
    with store.client(tenant="t") as owner, store.client(tenant="t") as reader:
        owner.acquire([master_key, *keys])
        publish(owner, master_key, master_payload(master))
        publish(owner, keys[0], piece_payload(piece), family="council", next_use=3)
        publish(owner, keys[1], piece_payload(dense))
        m_hit, p_hit, d_hit = (
            reader.acquire([master_key]).hits
            + reader.acquire([keys[0]]).hits
            + reader.acquire([keys[1]]).hits
        )
        with reader.read(m_hit) as entry:
            stored_master = read_master(entry.data, CONFIG)
        with reader.read(p_hit) as entry:
            stored_piece = read_piece(entry.data)
        with reader.read(d_hit) as entry:
            stored_dense = read_piece(entry.data)
        assert torch.equal(stored_master.blocks, master.blocks)
        k, v = restore_piece(stored_piece, stored_master, CONFIG)
        assert torch.equal(torch.cat((k, v)), torch.cat(restore_piece(piece, master, CONFIG)))
        assert restore_piece(stored_dense, None, CONFIG)[0].shape[1] == 30
        with pytest.raises(StoreError, match="not a master entry"), reader.read(p_hit) as entry:
            read_master(entry.data, CONFIG)
        corrupt_segment(p_hit.name, offset=p_hit.size - 5)
        with pytest.raises(EntryLost, match="checksum"):
            reader.read(p_hit)
        assert reader.acquire([keys[0]]).lead == (keys[0],)  # dropped: the reader recomputes
