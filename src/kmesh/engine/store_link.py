"""The reference engine's side of the keyed-state store: restore on a local miss, publish after.

When a sequence is admitted, the full blocks of its prompt that the local prefix cache misses are
looked up in the store (kmesh store serve) by their chained block keys:
- blocks the store holds are copied from shared memory into the sequence's own KV blocks (one copy
  per block, the bytes never cross the socket) and count as restored, not computed;
- if another engine is computing the next block, the sequence is not admitted yet (`lookup`
  answers None) and asks again at the next step, while the engine goes on with other requests;
  after `wait_seconds` it stops waiting: it restores what is published and computes the rest,
  leading nothing;
- the blocks this engine is first to need, it leads: once computed, each is published. While a
  model step runs, a background thread renews the leases of the claims held (every third of the
  store's lease), so a long prefill keeps them; the thread and the engine share the connections
  under one lock.
A block's payload is its K and V for every layer, [2, layers, block_size, kv_heads, head_dim] in
the engine's dtype; its meta names dtype and shape, and an entry whose meta does not match this
engine's layout is treated as a miss.

Every store failure falls back to computing: a store that goes away is dropped for the rest of the
engine's life (the request still succeeds), an entry that fails its checksum ends the restore at
that block, a publish that does not fit is skipped. The store files entries by tenant: each tenant
salt talks to the store on its own connection.
"""

import logging
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from kmesh.engine.sequence import Sequence
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.store import Acquired, StoreError, StoreRefused, StoreUnavailable, TenantClients

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Claims:
    """Blocks a sequence leads (must publish once computed), by block index."""

    tenant: str | None
    keys: dict[int, bytes] = field(default_factory=dict)


class StoreLink:
    def __init__(self, socket_path: str, cache: PagedKVCache, wait_seconds: float = 30.0) -> None:
        self.socket_path = socket_path
        self.cache = cache
        self.wait_seconds = wait_seconds
        self.available = True
        self._client = TenantClients(socket_path)
        self._claims: dict[int, _Claims] = {}  # by id(seq)
        # Sequences waiting for another engine's blocks (by id(seq)) -> when they began.
        self._waiting: dict[int, float] = {}
        self._lease = 60.0  # the store's, from its last answer
        self._lock = threading.Lock()  # the engine's thread and the lease renewer
        k = cache.k
        # A block's payload: K and V of every layer.
        self.block_shape = (2, k.shape[0], cache.block_size, k.shape[2], k.shape[3])
        self.meta = {"dtype": str(k.dtype), "shape": list(self.block_shape)}

    def lookup(self, seq: Sequence, first: int, last: int) -> Acquired | None:
        """What the store holds of blocks [first, last) of the sequence, and which of the rest
        it now leads; None while another engine computes the next block (ask again later)."""
        if not self.available or first >= last:
            return Acquired((), (), None, self._lease)
        keys = [bytes(key) for key in seq.block_keys[first:last]]
        try:
            with self._lock:
                got = self._client(seq.request.tenant_salt).acquire(keys)
        except StoreError as error:
            self._failed(seq, error, 0)
            return Acquired((), (), None, self._lease)
        self._lease = got.lease
        if got.waiting_on is not None:
            since = self._waiting.setdefault(id(seq), time.monotonic())
            if time.monotonic() - since < self.wait_seconds:
                return None
        self._waiting.pop(id(seq), None)
        if got.lead:
            start = first + len(got.hits)
            leads = {start + i: key for i, key in enumerate(got.lead)}
            self._claims[id(seq)] = _Claims(seq.request.tenant_salt, leads)
        return got

    def restore(self, seq: Sequence, first: int, got: Acquired) -> int:
        """Fill blocks from `first` on (the sequence's block table holds them) with `got`'s hits,
        in order, as far as they read back; returns how many blocks were restored."""
        restored = 0
        try:
            with self._lock:
                client = self._client(seq.request.tenant_salt)
                for hit in got.hits:
                    with client.read(hit) as entry:
                        if entry.meta != self.meta:
                            # Another layout under the same key (e.g. another dtype): compute
                            # the rest here and lead nothing.
                            self._abandon(seq)
                            break
                        self.write_block(seq.block_table[first + restored], entry.data)
                    restored += 1
        except StoreError as error:
            return self._failed(seq, error, restored)
        return restored

    @contextmanager
    def leases_renewed(self) -> Iterator[None]:
        """While the body runs (a model step), renew the leases of the claims held."""
        if not self._claims or not self.available:
            yield
            return
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew_until, args=(stop,), daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()

    def _renew_until(self, stop: threading.Event) -> None:
        while not stop.wait(self._lease / 3):
            with self._lock:
                try:
                    for tenant in {claims.tenant for claims in self._claims.values()}:
                        self._client(tenant).renew()
                except StoreError as error:  # the engine's next call meets it too
                    log.info("kmesh store: could not renew leases: %s", error)
                    return

    def publish(self, seq: Sequence, num_full_blocks: int) -> None:
        """Publish the led blocks that are now computed."""
        claims = self._claims.get(id(seq))
        if claims is None or not self.available:
            return
        ready = sorted(i for i in claims.keys if i < num_full_blocks)
        try:
            with self._lock:
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
        """The sequence ends (or is aborted): abandon what it led and did not publish, so a
        waiter takes over."""
        self._waiting.pop(id(seq), None)
        with self._lock:
            self._abandon(seq)

    def _abandon(self, seq: Sequence) -> None:
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
            self._abandon(seq)
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
