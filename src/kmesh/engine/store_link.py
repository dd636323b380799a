"""The reference engine's side of the keyed-state store: restore on a local miss, publish after.

When a sequence is admitted, the full blocks of its prompt that the local prefix cache misses are
looked up in the store (kmesh store serve) by their chained block keys:
- blocks the store holds are copied from shared memory into the sequence's own KV blocks (one copy
  per block, the bytes never cross the socket) and count as restored, not computed;
- if another engine is computing the next block, admission waits for it (up to `wait_seconds`;
  the engine loop is single-threaded, so the whole engine waits) and then restores;
- the blocks this engine is first to need, it leads: once computed, each is published.
A block's payload is its K and V for every layer, [2, layers, block_size, kv_heads, head_dim] in
the engine's dtype; its meta names dtype and shape, and an entry whose meta does not match this
engine's layout is treated as a miss.

Every store failure falls back to computing: a store that goes away is dropped for the rest of the
engine's life (the request still succeeds), an entry that fails its checksum ends the restore at
that block, a publish that does not fit is skipped. The store files entries by tenant: each tenant
salt talks to the store on its own connection.
"""

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from kmesh.engine.sequence import Sequence
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.store import StoreError, StoreRefused, StoreUnavailable, TenantClients

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Claims:
    """Blocks a sequence leads (must publish once computed), by block index."""

    keys: dict[int, bytes] = field(default_factory=dict)


class StoreLink:
    def __init__(self, socket_path: str, cache: PagedKVCache, wait_seconds: float = 30.0) -> None:
        self.socket_path = socket_path
        self.cache = cache
        self.wait_seconds = wait_seconds
        self.available = True
        self._client = TenantClients(socket_path)
        self._claims: dict[int, _Claims] = {}  # by id(seq)
        k = cache.k
        # A block's payload: K and V of every layer.
        self.block_shape = (2, k.shape[0], cache.block_size, k.shape[2], k.shape[3])
        self.meta = {"dtype": str(k.dtype), "shape": list(self.block_shape)}

    def restore(self, seq: Sequence, first: int, last: int) -> int:
        """Fill blocks [first, last) of the sequence from the store, in order, as far as the store
        holds them; lead the rest. Returns how many blocks were restored."""
        if not self.available or first >= last:
            return 0
        keys = [bytes(key) for key in seq.block_keys[first:last]]
        restored = 0
        try:
            client = self._client(seq.request.tenant_salt)
            got = client.acquire(keys)
            if got.waiting_on is not None:
                got = client.wait(keys, timeout=self.wait_seconds)
            if got.lead:
                start = first + len(got.hits)
                self._claims[id(seq)] = _Claims({start + i: key for i, key in enumerate(got.lead)})
            for hit in got.hits:
                with client.read(hit) as entry:
                    if entry.meta != self.meta:
                        # Another layout under the same key (e.g. another dtype): compute the
                        # rest here and lead nothing.
                        self.release(seq)
                        break
                    self.write_block(seq.block_table[first + restored], entry.data)
                restored += 1
            return restored
        except StoreError as error:
            return self._failed(seq, error, restored)

    def publish(self, seq: Sequence, num_full_blocks: int) -> None:
        """Publish the led blocks that are now computed."""
        claims = self._claims.get(id(seq))
        if claims is None or not self.available:
            return
        ready = sorted(i for i in claims.keys if i < num_full_blocks)
        try:
            client = self._client(seq.request.tenant_salt)
            for index in ready:
                key = claims.keys.pop(index)
                payload = self._read_block(seq.block_table[index]).numpy().view(np.uint8)

                def write(target: memoryview, payload: np.ndarray = payload) -> None:
                    np.frombuffer(target, dtype=np.uint8)[:] = payload.reshape(-1)

                try:
                    client.publish_into(key, payload.nbytes, write, self.meta)
                except StoreRefused as refused:
                    log.info("kmesh store: keeping block %d local: %s", index, refused)
        except StoreError as error:
            self._failed(seq, error, 0)  # forgets the sequence's claims
            return
        if not claims.keys:
            del self._claims[id(seq)]

    def release(self, seq: Sequence) -> None:
        """The sequence ends: abandon what it led and did not publish, so a waiter takes over."""
        claims = self._claims.pop(id(seq), None)
        if claims is None or not claims.keys or not self.available:
            return
        try:
            self._client(seq.request.tenant_salt).abandon(list(claims.keys.values()))
        except StoreError as error:
            self._failed(seq, error, 0)

    def close(self) -> None:
        self._client.close()

    def _failed(self, seq: Sequence, error: StoreError, restored: int) -> int:
        if isinstance(error, StoreUnavailable):
            log.warning("kmesh store: unavailable, computing without it from now on: %s", error)
            self.available = False
            self._claims.clear()
            self.close()
        else:
            log.info("kmesh store: %s; computing instead", error)
            self.release(seq)
        return restored

    def write_block(self, block_id: int, data: memoryview) -> None:
        """Copy one block from shared memory into the cache (one copy, no intermediate)."""
        with warnings.catch_warnings():  # read-only shared memory: torch only reads from it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            block = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
        block = block.view(self.cache.k.dtype).view(self.block_shape)
        slots = self.cache.slots([block_id], 0, self.cache.block_size)
        self.cache.k[:, slots] = block[0]
        self.cache.v[:, slots] = block[1]
        del block

    def _read_block(self, block_id: int) -> torch.Tensor:
        slots = self.cache.slots([block_id], 0, self.cache.block_size)
        return torch.stack((self.cache.k[:, slots], self.cache.v[:, slots])).contiguous()
