"""The reference engine's blocks in the keyed-state store: restore on a local miss, publish after.

When a sequence is admitted, the full blocks of its prompt that the local prefix cache misses are
looked up in the store (kmesh store serve) by their chained block keys, under the store policy
both engines follow (kmesh/store/policy.py):
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
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kmesh.engine.sequence import Sequence
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.store import Acquired, StoreError, StoreRefused
from kmesh.store.policy import StorePolicy
from kmesh.store.tensors import segment_tensor, tensor_bytes

log = logging.getLogger(__name__)


class BlockStore:
    """One engine's KV blocks in a store: the store policy plus copies in and out of its
    paged cache. Sequences are named by id(seq) in the policy."""

    def __init__(self, socket_path: str, cache: PagedKVCache, wait_seconds: float = 30.0) -> None:
        self.socket_path = socket_path
        self.cache = cache
        self.policy = StorePolicy(socket_path, wait_seconds)
        self._lock = threading.Lock()  # the engine's thread and the lease renewer
        k = cache.k
        # A block's payload: K and V of every layer.
        self.block_shape = (2, k.shape[0], cache.block_size, k.shape[2], k.shape[3])
        self.meta = {"dtype": str(k.dtype), "shape": list(self.block_shape)}

    @property
    def available(self) -> bool:
        return self.policy.available

    @property
    def wait_seconds(self) -> float:
        return self.policy.max_wait_s

    @wait_seconds.setter
    def wait_seconds(self, seconds: float) -> None:
        self.policy.max_wait_s = seconds

    def lookup(self, seq: Sequence, first: int, last: int) -> Acquired | None:
        """What the store holds of blocks [first, last) of the sequence, and which of the rest
        it now leads; None while another engine computes the next block (ask again later)."""
        keys = [bytes(key) for key in seq.block_keys[first:last]]
        with self._lock:
            return self.policy.acquire(id(seq), seq.request.tenant_salt, keys, first, last)

    def restore(self, seq: Sequence, first: int, got: Acquired) -> int:
        """Fill blocks from `first` on (the sequence's block table holds them) with `got`'s hits,
        in order, as far as they read back; returns how many blocks were restored."""
        restored = 0
        with self._lock:
            try:
                client = self.policy.client(seq.request.tenant_salt)
                for hit in got.hits:
                    with client.read(hit) as entry:
                        if entry.meta != self.meta:
                            # Another layout under the same key (e.g. another dtype): compute
                            # the rest here and lead nothing.
                            self.policy.abandon(id(seq))
                            break
                        self.write_block(seq.block_table[first + restored], entry.data)
                    restored += 1
            except StoreError as error:
                self.policy.failed(id(seq), error)
        return restored

    @contextmanager
    def leases_renewed(self) -> Iterator[None]:
        """While the body runs (a model step), renew the leases of the claims held."""
        if not self.policy.leading or not self.available:
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
        while not stop.wait(self.policy.lease / 3):
            with self._lock:
                try:
                    self.policy.renew()
                except StoreError as error:  # the engine's next call meets it too
                    log.info("kmesh store: could not renew leases: %s", error)
                    return

    def publish(self, seq: Sequence, num_full_blocks: int) -> None:
        """Publish the led blocks that are now computed."""
        tenant = seq.request.tenant_salt
        with self._lock:
            ready = self.policy.take_ready(id(seq), num_full_blocks)
            if not ready:
                return
            try:
                client = self.policy.client(tenant)
                for index, key in ready:
                    block = self._read_block(seq.block_table[index])
                    size = block.numel() * block.element_size()
                    try:
                        client.publish_into(key, size, tensor_bytes([block]), self.meta)
                    except StoreRefused as refused:
                        log.info("kmesh store: keeping block %d local: %s", index, refused)
                    finally:
                        self.policy.done(tenant, key)
            except StoreError as error:
                self.policy.failed(id(seq), error)  # gives up the sequence's other claims

    def release(self, seq: Sequence) -> None:
        """The sequence ends (or is aborted): abandon what it led and did not publish, so a
        waiter takes over."""
        with self._lock:
            self.policy.release(id(seq))

    def close(self) -> None:
        self.policy.close()

    def write_block(self, block_id: int, data: memoryview) -> None:
        """Copy one block from shared memory into the cache (one copy, no intermediate)."""
        block = segment_tensor(data).view(self.cache.k.dtype).view(self.block_shape)
        slots = self.cache.slots([block_id], 0, self.cache.block_size)
        self.cache.k[:, slots] = block[0]
        self.cache.v[:, slots] = block[1]
        del block

    def _read_block(self, block_id: int) -> torch.Tensor:
        slots = self.cache.slots([block_id], 0, self.cache.block_size)
        return torch.stack((self.cache.k[:, slots], self.cache.v[:, slots])).contiguous()
