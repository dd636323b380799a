"""The store as `kmesh bench capacity`'s KMesh strategies use it (bench/capacity/kmesh.py): a
member's transcript is a chain of pieces (store/shared/group_state.py), published unless held,
declared for its next use, and read back up to the first piece lost.

Every failed call degrades instead of raising: a piece lost (the run computes it instead), a
refusal (the piece is not kept), a digest mismatch (counted), or the store gone (used no more:
every piece is computed).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.config import ModelConfig
from kmesh.kv.master_mirror import Master
from kmesh.store import StoreClient, StoreError, StoreUnavailable
from kmesh.store.shared.group_state import (
    Payload,
    PieceMismatch,
    fetch_master,
    publish,
    read_piece,
    restore_piece,
)

FAMILY = "council"


@dataclass(slots=True)
class RoundStats:
    round_computed: float = 0.0
    recomputed: float = 0.0
    seconds: float = 0.0
    bytes_restored: int = 0
    pieces_lost: int = 0
    restores_checked: int = 0  # pieces restored and found bit-identical (digest) to the published
    restore_mismatches: int = 0  # pieces whose restore was not (recomputed instead)
    held_bytes: int = 0
    transcript_bytes: float = 0.0  # per member
    own_bytes: float = 0.0  # per member: its own pieces, nothing shared


class PieceStore:
    """A store client for chains of pieces; `declare`: pin what is published for its next use
    (the store's retention acts on it)."""

    def __init__(self, socket: str, config: ModelConfig, declare: bool) -> None:
        self.client = StoreClient(socket)
        self.config = config
        self.declare = declare
        self.available = True  # False once the store is gone

    def close(self) -> None:
        self.client.close()

    def used_bytes(self, stats: RoundStats) -> int:
        """The store's bytes held (0 when it is gone)."""
        if self.available:
            try:
                return int(self.client.stats()["used"])
            except StoreError as error:
                self._failed(error, stats)
        return 0

    def restore(
        self, keys: Sequence[bytes], stats: RoundStats
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and V rows of the chain's pieces, from the first up to the first one lost."""
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        masters: dict[bytes, Master] = {}
        try:
            got = self.client.acquire(keys) if self.available else None
            if got is not None:
                self.client.abandon(got.lead)
            for hit in () if got is None else got.hits:
                with self.client.read(hit) as entry:
                    piece = read_piece(entry.data)
                stats.bytes_restored += hit.size
                master = None
                if piece.master is not None:
                    master = masters.get(piece.master) or self._read_master(piece.master, stats)
                    masters[piece.master] = master
                k, v = restore_piece(piece, master, self.config)
                stats.restores_checked += 1
                ks.append(k)
                vs.append(v)
        except StoreError as error:
            self._failed(error, stats)
        return ks, vs

    def _read_master(self, key: bytes, stats: RoundStats) -> Master:
        read = fetch_master(self.client, key, self.config)
        if read is None:
            raise StoreError("the round's master is gone")
        stats.bytes_restored += read[1]
        return read[0]

    def publish(
        self, key: bytes, payload: Payload, next_use: float | None, replace: bool = False
    ) -> None:
        """Publish `key` unless the store has it (`replace`: drop what it has first); declared
        for `next_use` when this store declares. A store that cannot fit it refuses: the next
        restore finds it lost."""
        if not self.available:
            return
        family = FAMILY if self.declare else None
        try:
            got = self.client.acquire([key])
            if got.hits and replace:
                self.client.drop(got.hits[0])
                got = self.client.acquire([key])
            if got.lead:
                publish(self.client, key, payload, family, next_use)
            elif family is not None:
                self.client.pin(family, [key], next_use)
        except StoreError as error:
            self._failed(error, None)

    def declare_use(self, keys: Sequence[bytes], next_use: float, stats: RoundStats) -> None:
        """Declare `keys`' next use to the store, when this store declares."""
        if self.declare and self.available:
            try:
                self.client.pin(FAMILY, keys, next_use)
            except StoreError as error:
                self._failed(error, stats)

    def _failed(self, error: StoreError, stats: RoundStats | None) -> None:
        """Module docstring: the store gone is used no more; a mismatch is counted."""
        if isinstance(error, StoreUnavailable):
            self.available = False
        if isinstance(error, PieceMismatch) and stats is not None:
            stats.restore_mismatches += 1
