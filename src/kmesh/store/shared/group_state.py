"""Group state in the store: a round's master once, every member's transcript as pieces of it.

What a round's member must keep between rounds is its transcript: its prompt minus the
instruction, the start of its next prompt. The store holds it as a chain of pieces, each the
rows [start, end) of that transcript, keyed like exact blocks through their parent
(state/keys.py::piece_key), so a piece stands for the whole transcript up to its end:
- a dense piece holds its rows: the family trunk (the same tokens and parent for every member,
  so one entry serves all), a member's private rows;
- a mirrored piece holds the rows a round's master holds as mirrors (kv/master_mirror.py: the
  member's order and start, a block table, the block-sparse diff of the blocks its recovery
  recomputed) and the master's key; rows no mirror covers are dense in it.
Masters are entries of their own, one per round, read by every member's mirrored pieces, and by
engines that recover a round's siblings (masters.py::StoreMasters: a round spread over
several engines mirrors the master the first of them built). A master entry holds its segments'
rows packed, without the padding of their last blocks; reading it lays them out in blocks again.

`restore_piece` restores each mirror (kv/mirror_restore.py: master slots copied, keys turned,
the diff over them), and the dense rows placed; it checks the rows against the BLAKE3 digest
the piece was published with, so what comes back is bit-identical to what was stored or refused
(`PieceMismatch`). Entries also carry the store's CRC-32: a corrupted entry is dropped
when read.

An entry's payload is self-describing: a little-endian u32 header length, a MessagePack header
(the scalars, and each tensor's name, dtype and shape), then the tensors' bytes one after
another. Entries name other entries only by key: any engine attached to the store restores them.
"""

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import torch

from kmesh.compute.config import ModelConfig
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror, kv_digest
from kmesh.kv.mirror_restore import restore_into
from kmesh.kv.segment_kv import SegmentKV
from kmesh.store.client import StoreClient
from kmesh.store.errors import StoreError
from kmesh.store.tensors import segment_tensor, tensor_bytes

_HEADER = struct.Struct("<I")
# (size in bytes, the tensors in order, the header bytes before them)
Payload = tuple[int, list[torch.Tensor], bytes]
# Where a payload's tensor lies: its byte offset, and a tensor of its dtype and shape on the meta
# device (no memory).
TensorAt = tuple[int, torch.Tensor]
_FORMAT = 2
T = TypeVar("T")


class PieceMismatch(StoreError):
    """A restored piece's rows are not the rows it was published with (a master replaced, a
    layout changed): the caller recomputes them."""


@dataclass(frozen=True, slots=True, eq=False)  # tensor fields: no value equality
class Piece:
    """Rows [start, end) of one member's transcript."""

    start: int
    end: int
    master: bytes | None  # key of the master entry the mirrors read (None: dense only)
    mirrors: tuple[Mirror, ...]
    dense_positions: torch.Tensor  # [n] int64 positions in [start, end) no mirror covers
    dense_k: torch.Tensor  # [layers, n, kv_heads, head_dim]
    dense_v: torch.Tensor
    digest: str  # BLAKE3 of the whole rows k then v (kv_digest)

    @classmethod
    def of(
        cls,
        start: int,
        k: torch.Tensor,
        v: torch.Tensor,
        mirrors: Sequence[Mirror] = (),
        master: bytes | None = None,
    ) -> "Piece":
        """The piece of rows k, v [L, n, H, D] at positions start..start+n: what `mirrors`
        cover (their restore must give these rows) is kept as the mirrors, the rest dense."""
        if mirrors and master is None:
            raise ValueError("a piece with mirrors needs its master's key")
        n = k.shape[1]
        covered = torch.zeros(n, dtype=torch.bool)
        for mirror in mirrors:
            rows = mirror.positions - start
            if rows.numel() and (rows.min() < 0 or rows.max() >= n):
                raise ValueError(f"a mirror reaches outside the rows [{start}, {start + n})")
            covered[rows] = True
        dense = (~covered).nonzero().flatten()
        return cls(
            start,
            start + n,
            master if mirrors else None,
            tuple(mirrors),
            dense + start,
            k.index_select(1, dense).contiguous(),
            v.index_select(1, dense).contiguous(),
            kv_digest(k, v),
        )

    @property
    def nbytes(self) -> int:
        """What the piece holds beyond its master: its mirrors and dense rows."""
        dense = (self.dense_positions, self.dense_k, self.dense_v)
        return sum(m.nbytes for m in self.mirrors) + sum(_bytes(t) for t in dense)


def restore_piece(
    piece: Piece, master: Master | None, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's rows (k, v), each [L, end - start, H, D], checked against its digest."""
    k, v = _rows(piece, master, config)
    if kv_digest(k, v) != piece.digest:
        raise PieceMismatch("the restored rows are not the rows the piece was published with")
    return k, v


def gives_back(
    piece: Piece, master: Master | None, config: ModelConfig, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Whether restoring the piece gives exactly rows k, v (those it was made of) back: their
    bytes compared, so the rows `Piece.of` hashed are not hashed a second time."""
    try:
        rk, rv = _rows(piece, master, config)
    except PieceMismatch:
        return False
    return _same_bytes(rk, k) and _same_bytes(rv, v)


def _rows(
    piece: Piece, master: Master | None, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's rows, unchecked; PieceMismatch if its mirrors do not fit `master`."""
    if piece.mirrors and master is None:
        raise PieceMismatch("the piece's mirrors need their master")
    n = piece.end - piece.start
    shape = (piece.dense_k.shape[0], n, *piece.dense_k.shape[2:])
    k = piece.dense_k.new_empty(shape)
    v = piece.dense_v.new_empty(shape)
    dense = piece.dense_positions - piece.start
    k[:, dense] = piece.dense_k
    v[:, dense] = piece.dense_v
    for mirror in piece.mirrors:
        assert master is not None
        rows = mirror.rows(piece.start)
        if rows.start < 0 or rows.stop > n:
            raise PieceMismatch("a mirror reaches outside the piece's rows")
        count = mirror.positions.numel()
        if not torch.equal(mirror.positions, mirror.start + torch.arange(count)):
            raise PieceMismatch("a mirror's positions do not run on from its start")
        try:  # restored where its rows lie
            restore_into(master, mirror, config, k[:, rows], v[:, rows])
        except (ValueError, IndexError, RuntimeError) as error:
            raise PieceMismatch(f"a mirror does not fit its master: {error}") from None
    return k, v


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit identity, as equal kv_digests would say (NaN and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = (t.detach().cpu().contiguous().view(torch.uint8) for t in (a, b))
    return torch.equal(a, b)


# -- payloads --------------------------------------------------------------------------------


def master_payload(master: Master) -> Payload:
    """The master's segments' rows, packed: its blocks' padding is not stored (read_master
    pads them again)."""
    segments = master.segments()
    head = {
        "segment_lengths": master.segment_lengths,
        "segment_starts": master.segment_starts,
        "block_size": master.block_size,
    }
    rows = {
        "k": torch.cat([s.k for s in segments], dim=1),  # [L, T, H, D], canonical order
        "v": torch.cat([s.v for s in segments], dim=1),
    }
    return _payload("master", head, rows)


def piece_payload(piece: Piece) -> Payload:
    tensors = {
        "dense_positions": piece.dense_positions,
        "dense_k": piece.dense_k,
        "dense_v": piece.dense_v,
    }
    mirrors = []
    for i, mirror in enumerate(piece.mirrors):
        mirrors.append(
            {"order": mirror.order, "start": mirror.start, "dropped": mirror.dropped_error}
        )
        for name in _MIRROR_TENSORS:
            tensors[f"m{i}.{name}"] = getattr(mirror, name)
    head = {
        "start": piece.start,
        "end": piece.end,
        "master": piece.master,
        "digest": piece.digest,
        "mirrors": mirrors,
    }
    return _payload("piece", head, tensors)


def segment_payload(segment: SegmentKV) -> Payload:
    return _payload("segment", {}, {"k": segment.k, "v": segment.v})


def read_master(data: memoryview, config: ModelConfig) -> Master:
    head, tensors = _unpack("master", data)
    k, v = tensors["k"], tensors["v"]
    lengths = [int(n) for n in head["segment_lengths"]]
    if len(lengths) != len(head["segment_starts"]) or sum(lengths) != k.shape[1]:
        raise StoreError(f"not a master entry of format {_FORMAT}: its rows and lengths differ")
    segments = [
        MasterSegment(k_rows, v_rows, torch.arange(start, start + k_rows.shape[1]))
        for k_rows, v_rows, start in zip(
            k.split(lengths, dim=1), v.split(lengths, dim=1), head["segment_starts"], strict=True
        )
    ]
    try:
        return Master.build(segments, head["block_size"], config)
    except ValueError as error:
        raise StoreError(f"not a master entry of format {_FORMAT}: {error}") from None


def read_segment(data: memoryview) -> SegmentKV:
    _, tensors = _unpack("segment", data)
    return SegmentKV(tensors["k"], tensors["v"])


def read_piece(data: memoryview) -> Piece:
    head, tensors = _unpack("piece", data)
    mirrors = tuple(
        Mirror(
            order=tuple(m["order"]),
            start=m["start"],
            dropped_error=m["dropped"],
            **{name: tensors[f"m{i}.{name}"] for name in _MIRROR_TENSORS},
        )
        for i, m in enumerate(head["mirrors"])
    )
    return Piece(
        head["start"],
        head["end"],
        head["master"],
        mirrors,
        tensors["dense_positions"],
        tensors["dense_k"],
        tensors["dense_v"],
        head["digest"],
    )


def fetch(client: StoreClient, key: bytes, read: Callable[[memoryview], T]) -> tuple[T, int] | None:
    """What `read` makes of the entry stored under `key`, and the entry's bytes; None if the
    store lacks it (nothing is claimed: a miss is the caller's to compute or not)."""
    got = client.acquire([key])
    client.abandon(got.lead)
    if not got.hits:
        return None
    with client.read(got.hits[0]) as entry:
        return read(entry.data), got.hits[0].size


def fetch_master(client: StoreClient, key: bytes, config: ModelConfig) -> tuple[Master, int] | None:
    """The master stored under `key` and its bytes, or None if the store lacks it."""
    return fetch(client, key, lambda data: read_master(data, config))


def publish(
    client: StoreClient,
    key: bytes,
    payload: Payload,
    family: str | None = None,
    next_use: float | None = None,
) -> None:
    """Publish a led key's payload (`master_payload`, `piece_payload`); see
    StoreClient.publish_into."""
    size, tensors, header = payload
    client.publish_into(key, size, [header, *tensor_bytes(tensors)], None, family, next_use)


_MIRROR_TENSORS = ("block_table", "token_slots", "positions", "diff_index", "diff_blocks")
# What reading a payload that is not what its header says raises.
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, struct.error, msgspec.DecodeError)


def _payload(kind: str, head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Payload:
    """(size, tensors in order, header bytes) of a payload."""
    described = [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()
    ]
    encoded = msgspec.msgpack.encode(
        {"format": _FORMAT, "kind": kind, "head": head, "tensors": described}
    )
    header = _HEADER.pack(len(encoded)) + encoded
    ordered = [t.detach().cpu().contiguous() for t in tensors.values()]
    return len(header) + sum(_bytes(t) for t in ordered), ordered, header


def _unpack(kind: str, data: memoryview) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A payload's head and its tensors (copied out of `data`). StoreError if it is not a
    `kind` payload of this format."""
    head, placed = describe(kind, data)
    flat = segment_tensor(data)
    tensors = {}
    for name, (offset, t) in placed.items():
        tensors[name] = flat[offset : offset + _bytes(t)].clone().view(t.dtype).view(t.shape)
    return head, tensors


def describe(kind: str, data: memoryview) -> tuple[dict[str, Any], dict[str, TensorAt]]:
    """A payload's head and where each tensor lies in `data` (nothing read but the header).
    StoreError if it is not a `kind` payload of this format."""
    try:
        (length,) = _HEADER.unpack_from(data)
        body = msgspec.msgpack.decode(data[_HEADER.size : _HEADER.size + length])
        if body["format"] != _FORMAT or body["kind"] != kind:
            raise ValueError(f"a {body['kind']} payload of format {body['format']}")
        offset = _HEADER.size + length
        placed = {}
        for name, dtype, shape in body["tensors"]:
            meta = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            placed[name] = (offset, meta)
            offset += _bytes(meta)
        if offset > data.nbytes:
            raise ValueError("the payload is shorter than its header says")
        return body["head"], placed
    except _MALFORMED as e:
        raise StoreError(f"not a {kind} entry of format {_FORMAT}: {e}") from None


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
