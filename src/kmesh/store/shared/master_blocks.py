"""Masters read block by block (group_state.py's master entries): a member's mirrored pieces read
only the master blocks their mirrors gather and their diffs do not replace, and an engine keeps
what it read of each master, so a round's members restored on one engine read each block once.

A master entry holds its segments' rows packed (no block padding); master block b of segment s
is that segment's rows [(b - first) * block_size, ...) up to its length, so a block's rows are
one contiguous run per layer of K and of V in the entry (one strided copy for K, one for V).
What is read counts the header and those rows. A master kept here and the entry it was read
from must have the same geometry (segment lengths and starts, block size, dtype); a different
one under the same key (a master replaced) is refused, and a replaced master of the same
geometry is caught by the pieces' digests (PieceMismatch: the caller forgets the master and
recomputes).
"""

import bisect
from collections import OrderedDict
from collections.abc import Collection

import torch

from kmesh.compute.config import ModelConfig
from kmesh.kv.master_mirror import Master, MasterSegment
from kmesh.store.client import StoreClient
from kmesh.store.errors import StoreError
from kmesh.store.shared.group_state import Piece, PieceMismatch, describe, fetch
from kmesh.store.tensors import segment_tensor

# Masters kept for the next restores (a round's members read the same one).
MASTERS_KEPT = 2


def blocks_read_by(piece: Piece) -> set[int]:
    """The master blocks the piece's mirrors gather and do not replace by their diff blocks."""
    needed: set[int] = set()
    for mirror in piece.mirrors:
        kept = torch.ones(mirror.block_table.numel(), dtype=torch.bool)
        kept[mirror.diff_index] = False
        needed.update(mirror.block_table[kept].tolist())
    return needed


def read_master_blocks(
    data: memoryview, config: ModelConfig, blocks: Collection[int], into: Master | None
) -> tuple[Master, int]:
    """`into` (None: a master of zeros shaped like the entry's) with `blocks` read from the
    master entry `data`, and the bytes read. StoreError if it is not a master entry of this
    model, or not shaped like `into`, or lacks one of `blocks`."""
    head, placed = describe("master", data)
    try:
        lengths = tuple(int(n) for n in head["segment_lengths"])
        starts = tuple(int(s) for s in head["segment_starts"])
        block_size = int(head["block_size"])
        (k_at, k), (v_at, v) = placed["k"], placed["v"]
        layers, total, heads, dim = k.shape
        if v.shape != k.shape or v.dtype != k.dtype or sum(lengths) != total:
            raise ValueError("its rows and lengths differ")
        master = _zeros(lengths, starts, block_size, config, k.dtype) if into is None else into
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"not a master entry of this model: {error}") from None
    geometry = (master.segment_lengths, master.segment_starts, master.blocks.shape[2:])
    if geometry != (lengths, starts, (layers, block_size, heads, dim)) or (
        master.blocks.dtype != k.dtype
    ):
        raise StoreError("the master entry is not shaped like the master read before")
    flat = segment_tensor(data)
    row = heads * dim * k.element_size()
    packed_at = [sum(lengths[:i]) for i in range(len(lengths))]
    nbytes = k_at  # the header
    for b in sorted(blocks):
        segment = bisect.bisect_right(master.segment_first_block, b) - 1
        lo = (b - master.segment_first_block[segment]) * block_size
        hi = min(lengths[segment], lo + block_size)
        if segment < 0 or lo >= hi:
            raise StoreError(f"the master entry has no block {b}")
        for kv, at in enumerate((k_at, v_at)):
            target = master.blocks[b, kv, :, : hi - lo].view(torch.uint8)  # [L, n, H, D bytes]
            source = flat.as_strided(  # the same rows of every layer of the packed [L, T, H, D]
                target.shape,
                (total * row, row, row // heads, 1),
                at + (packed_at[segment] + lo) * row,
            )
            target.copy_(source)
        nbytes += 2 * layers * (hi - lo) * row
    return master, nbytes


class ReadMasters:
    """The masters one engine read, by store key, each with the blocks read so far; the last
    MASTERS_KEPT of them."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._read: OrderedDict[bytes, tuple[Master, set[int]]] = OrderedDict()

    def for_piece(self, client: StoreClient, piece: Piece) -> tuple[Master, int]:
        """The piece's master holding every block its mirrors read, and the bytes read for it
        now (the blocks read before are not read again). PieceMismatch if the store lacks it."""
        assert piece.master is not None
        key = piece.master
        held = self._read.get(key)
        master, have = (None, set()) if held is None else held
        missing = blocks_read_by(piece) - have
        nbytes = 0
        if master is None or missing:
            got = fetch(
                client, key, lambda data: read_master_blocks(data, self.config, missing, master)
            )
            if got is None:
                raise PieceMismatch("the piece's master was evicted")
            (master, nbytes), _ = got
            self._read[key] = (master, have | missing)
            while len(self._read) > MASTERS_KEPT:
                self._read.popitem(last=False)
        self._read.move_to_end(key)
        return master, nbytes

    def forget(self, key: bytes) -> None:
        """Drop a master whose pieces did not restore (replaced since): read it again next."""
        self._read.pop(key, None)


def _zeros(
    lengths: tuple[int, ...],
    starts: tuple[int, ...],
    block_size: int,
    config: ModelConfig,
    dtype: torch.dtype,
) -> Master:
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    segments = []
    for n, start in zip(lengths, starts, strict=True):
        zeros = torch.zeros((shape[0], n, *shape[1:]), dtype=dtype)
        segments.append(MasterSegment(zeros, zeros, torch.arange(start, start + n)))
    return Master.build(segments, block_size, config)
