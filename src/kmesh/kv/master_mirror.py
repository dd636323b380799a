"""Master-Mirror KV storage for an All-Gather round (as in TokenDance).

In an All-Gather round N siblings read the same N output segments, each in its own order and from
its own start position. The master holds the segments' KV once, densely, in blocks, every segment
starting a new block (its last block zero padded), keys as they were computed: segment i's at the
consecutive positions from `segment_starts[i]`. A sibling that reads a segment where it was
computed (the sibling the master was taken from) turns its keys by 0: bit-identical. A sibling
is a mirror: its segment order and start position, which say where every master token sits in
the sibling's prompt, plus a block-sparse diff of the sibling's blocks whose KV is not the
master's (the blocks its recovery recomputed). The sibling's blocks are the
master blocks of its segments, concatenated in its order, so a diff block lines up with one master
block.

Exact mode stores every given diff block: restore returns the sibling's KV bit-identically.
Tolerance mode drops a diff block whose KV lies within the tolerance of the master's (max abs
difference) and records the largest dropped difference.

Restoring a mirror (the master's rows turned to the sibling's positions, the diff over them) is
kv/mirror_restore.py. The sibling's recovery starts from the restore of a diff-free mirror and
stores recomputed whole blocks as the diff, so the blocks it kept and the blocks it stored both
come back bit-identical.
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import torch

from kmesh.compute.config import ModelConfig, RopeTable
from kmesh.compute.rope import rerotate_keys
from kmesh.kv.block_pool import blocks_for


def _rope_geometry(config: ModelConfig) -> tuple[int, int, int, tuple[RopeTable, ...]]:
    """What a key's bits and turns depend on: layers, kv heads, head_dim, each layer's table."""
    tables = tuple(layer.rope for layer in config.layers)
    return (config.num_layers, config.num_kv_heads, config.head_dim, tables)


@dataclass(frozen=True, slots=True, eq=False)  # tensor fields: no value equality
class MasterSegment:
    """One segment's KV as it was computed: an input of `Master.build`."""

    k: torch.Tensor  # [layers, n, kv_heads, head_dim]
    v: torch.Tensor  # [layers, n, kv_heads, head_dim]
    positions: torch.Tensor  # [n] consecutive: where the keys were computed


@dataclass(frozen=True, slots=True, eq=False)  # tensor fields: no value equality
class Master:
    """The round's segments' KV, dense, in blocks (keys at the positions they were computed at)."""

    blocks: torch.Tensor  # [B, 2, layers, block_size, kv_heads, head_dim]; [:, 0] K, [:, 1] V
    segment_lengths: tuple[int, ...]
    segment_first_block: tuple[int, ...]  # index of each segment's first block in `blocks`
    segment_starts: tuple[int, ...]  # position of each segment's first key
    block_size: int
    config: ModelConfig  # the RoPE the keys are rotated with

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    @property
    def block_positions(self) -> torch.Tensor:
        """[B] int64: position of the key in each block's first slot."""
        device = self.blocks.device
        positions = torch.zeros(self.blocks.shape[0], dtype=torch.int64, device=device)
        for first, length, start in zip(
            self.segment_first_block, self.segment_lengths, self.segment_starts, strict=True
        ):
            count = blocks_for(length, self.block_size)
            offsets = torch.arange(count, device=device) * self.block_size
            positions[first : first + count] = start + offsets
        return positions

    def segments(self) -> list[MasterSegment]:
        """Each segment's rows without their blocks' padding: `build` of them gives the master
        back bit for bit (its padding is zeros)."""
        out = []
        for first, length, start in zip(
            self.segment_first_block, self.segment_lengths, self.segment_starts, strict=True
        ):
            count = blocks_for(length, self.block_size)
            blocks = self.blocks[first : first + count]  # [count, 2, L, bs, H, D]
            rows = blocks.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :length]  # [2, L, n, H, D]
            positions = start + torch.arange(length, device=rows.device)
            out.append(MasterSegment(rows[0], rows[1], positions))
        return out

    @classmethod
    def build(
        cls,
        segments: Sequence[MasterSegment],
        block_size: int,
        config: ModelConfig,
    ) -> "Master":
        """The master of `segments`, in canonical order."""
        if not segments:
            raise ValueError("a master needs at least one segment")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        dtype = segments[0].k.dtype
        shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        lengths = []
        for i, segment in enumerate(segments):
            k, v, positions = segment.k, segment.v, segment.positions
            if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != shape:
                raise ValueError(
                    f"segment {i}: k has shape {tuple(k.shape)}, expected [L, n, H, D] with "
                    f"(L, H, D) = {shape}"
                )
            if v.shape != k.shape:
                raise ValueError(f"segment {i}: v shape {tuple(v.shape)} != k {tuple(k.shape)}")
            if positions.shape != (k.shape[1],):
                raise ValueError(
                    f"segment {i}: positions shape {tuple(positions.shape)}, expected "
                    f"({k.shape[1]},)"
                )
            if k.dtype != dtype or v.dtype != dtype:
                raise ValueError(f"segment {i}: dtype differs from segment 0's {dtype}")
            if k.shape[1] and not torch.equal(
                positions.long().cpu(), int(positions[0]) + torch.arange(k.shape[1])
            ):
                raise ValueError(f"segment {i}: positions are not consecutive")
            lengths.append(k.shape[1])
        counts = [blocks_for(n, block_size) for n in lengths]
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        layers, heads, dim = shape
        blocks = torch.zeros(
            (sum(counts), 2, layers, block_size, heads, dim),
            dtype=dtype,
            device=segments[0].k.device,
        )
        for segment, n, count, first in zip(segments, lengths, counts, firsts, strict=True):
            padded = segment.k.new_zeros((2, layers, count * block_size, heads, dim))
            padded[0, :, :n] = segment.k
            padded[1, :, :n] = segment.v
            blocks[first : first + count] = padded.view(
                2, layers, count, block_size, heads, dim
            ).permute(2, 0, 1, 3, 4, 5)
        starts = tuple(int(s.positions[0]) if len(s.positions) else 0 for s in segments)
        return cls(blocks, tuple(lengths), tuple(firsts), starts, block_size, config)


@dataclass(frozen=True, slots=True, eq=False)  # tensor fields: no value equality
class Mirror:
    """One sibling's view of the master: the master's segments in the sibling's `order`, placed
    contiguously from position `start`, plus a block-sparse diff."""

    order: tuple[int, ...]  # permutation of segment indices: the sibling reads order[0] first
    start: int  # position of the region's first token in the sibling's prompt
    block_table: torch.Tensor  # [b] int64: master block of each sibling block, in sibling order
    token_slots: torch.Tensor  # [T] int64: sibling slot (block * block_size + offset) per token
    positions: torch.Tensor  # [T] int64: each region token's position in the sibling's prompt
    diff_index: torch.Tensor  # [d] int64: sibling blocks stored in the diff, ascending
    diff_blocks: torch.Tensor  # [d, 2, layers, block_size, kv_heads, head_dim], sibling form
    dropped_error: float = 0.0  # tolerance mode: max abs difference of the dropped diff blocks

    @classmethod
    def of(cls, master: Master, order: Sequence[int], start: int) -> "Mirror":
        """The mirror of a sibling reading the segments in `order` from position `start`, with
        an empty diff."""
        order = tuple(order)
        if sorted(order) != list(range(len(master.segment_lengths))):
            raise ValueError(
                f"order {order} is not a permutation of the master's "
                f"{len(master.segment_lengths)} segment indices"
            )
        if start < 0:
            raise ValueError(f"start must be non-negative, got {start}")
        bs = master.block_size
        device = master.blocks.device
        tables, slots = [], []
        blocks_before = 0
        for segment in order:
            n = master.segment_lengths[segment]
            count = blocks_for(n, bs)
            first = master.segment_first_block[segment]
            tables.append(torch.arange(first, first + count, device=device))
            slots.append(blocks_before * bs + torch.arange(n, device=device))
            blocks_before += count
        block_table = torch.cat(tables)
        token_slots = torch.cat(slots)
        positions = start + torch.arange(token_slots.numel(), device=device)
        no_diff = torch.zeros(0, dtype=torch.int64, device=device)
        empty = master.blocks.new_zeros((0, *master.blocks.shape[1:]))
        return cls(order, start, block_table, token_slots, positions, no_diff, empty)

    @property
    def block_size(self) -> int:
        return self.diff_blocks.shape[3]

    def rows(self, origin: int) -> slice:
        """Its tokens' rows in KV whose first row holds position `origin` (its positions run on
        from `start`)."""
        return slice(self.start - origin, self.start - origin + self.positions.numel())

    def block_of_token(self) -> torch.Tensor:
        """[T] sibling block index of each region token."""
        return self.token_slots // self.block_size

    def tokens_of_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Sorted indices of the region tokens lying in sibling `blocks`."""
        self._check_blocks(blocks)
        return torch.isin(self.block_of_token(), blocks).nonzero().flatten()

    def with_diff(
        self,
        master: Master,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: torch.Tensor,
        tolerance: float | None = None,
    ) -> "Mirror":
        """A mirror whose diff (replacing this one's) holds sibling `blocks` of the sibling's own
        region KV k/v [L, T, H, D] (sibling form, at `positions`).

        Exact mode (tolerance None) stores every given block. Tolerance mode drops a block whose
        max abs difference from the master's KV (restored without diff) is <= tolerance.
        """
        expected = (master.blocks.shape[2], self.token_slots.numel(), *master.blocks.shape[4:])
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}, expected the region's [L, T, H, D] = "
                    f"{expected}"
                )
            if x.dtype != master.blocks.dtype:
                raise ValueError(f"{name} dtype {x.dtype} != the master's {master.blocks.dtype}")
        self._check_blocks(blocks)
        index = torch.unique(blocks.long())
        sibling = self._region_blocks(k, v, index)
        dropped_error = 0.0
        if tolerance is not None:
            base = _sibling_blocks(master, self, master.config).index_select(0, index)
            error = (sibling - base).abs().flatten(1).amax(dim=1)
            keep = error > tolerance
            if not keep.all():
                dropped_error = float(error[~keep].max())
            index, sibling = index[keep], sibling[keep]
        return Mirror(
            self.order,
            self.start,
            self.block_table,
            self.token_slots,
            self.positions,
            index,
            sibling,
            dropped_error,
        )

    @property
    def nbytes(self) -> int:
        """What the sibling costs beyond the master: diff blocks plus index tensors."""
        tensors = (
            self.diff_blocks,
            self.block_table,
            self.diff_index,
            self.token_slots,
            self.positions,
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    def dense_nbytes(self) -> int:
        """Bytes of a dense per-sibling copy of the region in blocks."""
        per_block = math.prod(self.diff_blocks.shape[1:]) * self.diff_blocks.element_size()
        return self.block_table.numel() * per_block

    def _check_blocks(self, blocks: torch.Tensor) -> None:
        count = self.block_table.numel()
        if blocks.dim() != 1:
            raise ValueError(f"blocks must be 1-D, got shape {tuple(blocks.shape)}")
        if blocks.numel() and (blocks.min() < 0 or blocks.max() >= count):
            raise ValueError(
                f"block index out of range: {blocks.tolist()} (the sibling has {count} blocks)"
            )

    def _region_blocks(self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Sibling blocks `index` (ascending) of region KV [L, T, H, D], zero padded:
        [len(index), 2, L, block_size, H, D]. Only those blocks' tokens are copied."""
        layers, _, heads, dim = k.shape
        out = k.new_zeros((index.numel(), 2, layers, self.block_size, heads, dim))
        if not index.numel():
            return out
        slot_of = torch.full_like(self.block_table, -1, dtype=torch.int64)
        slot_of[index] = torch.arange(index.numel(), device=index.device)
        block = slot_of[self.token_slots // self.block_size]
        rows = (block >= 0).nonzero().flatten()
        within = self.token_slots[rows] % self.block_size
        out[block[rows], 0, :, within] = k[:, rows].transpose(0, 1)
        out[block[rows], 1, :, within] = v[:, rows].transpose(0, 1)
        return out


def check_fits(master: Master, mirror: Mirror, config: ModelConfig) -> None:
    """Raise ValueError unless `mirror` reads `master` and `config` turns keys as it did."""
    if mirror.block_size != master.block_size:
        raise ValueError(
            f"mirror block size {mirror.block_size} != master block size {master.block_size}"
        )
    if mirror.block_table.numel() and mirror.block_table.max() >= master.blocks.shape[0]:
        raise ValueError(
            f"mirror's block table refers to block {mirror.block_table.max().item()}, the master "
            f"has {master.blocks.shape[0]}"
        )
    if _rope_geometry(config) != _rope_geometry(master.config):
        raise ValueError(
            "the config's (layers, kv_heads, head_dim, RoPE tables) differ from the master's: "
            "its keys would be turned wrong"
        )


def _sibling_blocks(master: Master, mirror: Mirror, config: ModelConfig) -> torch.Tensor:
    """The sibling's blocks [b, 2, L, block_size, H, D] in sibling form without its diff: the
    master's, gathered and rotated to sibling positions."""
    check_fits(master, mirror, config)
    gathered = master.blocks.index_select(0, mirror.block_table)
    count, _, layers, bs, heads, dim = gathered.shape
    # Master position of every slot; sibling position of every token's slot (padding: no turn).
    starts = master.block_positions[mirror.block_table]
    stored = (starts[:, None] + torch.arange(bs, device=starts.device)).flatten()
    target = stored.index_copy(0, mirror.token_slots, mirror.positions)
    keys = gathered[:, 0].transpose(0, 1).reshape(layers, count * bs, heads, dim)
    keys = rerotate_keys(keys, stored, target, config).view(layers, count, bs, heads, dim)
    return torch.stack((keys.transpose(0, 1), gathered[:, 1]), dim=1)


def kv_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """BLAKE3 hex of the contiguous bytes of k then v (for bit-identity checks). BLAKE3, not
    SHA-256: every published transcript piece digests all its rows, and BLAKE3 reads them 2.5x
    as fast here (46 MB: 10.6 against 26.3 ms); on the process's cores (the same digest: BLAKE3
    is a tree), 39 MB takes 6-7 ms on two against 9 on one."""
    digest = blake3.blake3(max_threads=len(os.sched_getaffinity(0)))
    for x in (k, v):
        for layer in x.detach().cpu():  # the same bytes as the whole, without copying it whole
            digest.update(layer.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()
