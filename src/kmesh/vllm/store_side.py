"""The scheduler half's store traffic, under the store policy both engines follow
(kmesh/store/policy.py): loads, leads, reserve -> worker copy -> commit, and family pins.

- Published blocks after vLLM's local hit are claimed as a hit and loaded by the worker half
  before the forward pass; they stay pinned for the request (family `kmesh-load:<id>`) until it
  finishes, so none is evicted before the worker loads it.
- While another engine computes the next loadable block, the request waits ("ask again later":
  vLLM keeps it queued and asks each step; with nothing of this engine running it first waits in
  the store for IDLE_WAIT_S), for at most MAX_WAIT_S; so across engines a shared trunk is computed
  once.
- The blocks no one has, this engine leads: once vLLM has computed one, a segment is reserved, the
  worker copies the block into it, and the checksum it reports is committed (None: abandoned).
- Families (store/family_pins.py): the trunk's blocks are pinned for the family while it is
  open here, and so is a member's transcript (its pieces and its round's master) at the
  `next_use` the member declared; when the family ends, each tenant's pins are closed.
Every store failure falls back to vLLM computing the tokens itself.
"""

import logging
from collections.abc import Sequence

from kmesh.store import Acquired, StoreError, StoreRefused
from kmesh.store.family_pins import MAX_OPEN_FAMILIES, FamilyPins
from kmesh.store.policy import StorePolicy, TenantKey
from kmesh.store.segments import encode_meta
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import SaveBlock
from kmesh.vllm.tracked import Tracked

log = logging.getLogger(__name__)

# While nothing of this engine runs, a request whose blocks another engine computes waits in the
# store this long per scheduler step instead of spinning.
IDLE_WAIT_S = 0.2
# A request stops waiting for another engine after this long and computes the blocks itself.
MAX_WAIT_S = 60.0


class StoreSide:
    """One engine's scheduler-side store traffic; requests are named by their vLLM ids."""

    def __init__(self, store: str | None, layout: BlockLayout) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.meta_bytes = encode_meta(layout.meta)
        self.policy = StorePolicy(store, MAX_WAIT_S)
        self.pins = FamilyPins(self.policy.client, MAX_OPEN_FAMILIES)
        # Reserved, waiting for the worker's copy -> the family to pin the entry for, if any.
        self._reserved: dict[TenantKey, str | None] = {}

    @property
    def available(self) -> bool:
        return self.policy.available

    def prefault(self, blocks: int) -> None:
        """Have the store make up to `blocks` segments of this engine's block size and fault
        them in now, at start (store/tier.py: spares), so that publishing a block later writes
        memory that is already there, as vLLM's own KV cache is."""
        if blocks <= 0 or not self.available:
            return
        try:
            warm = self.policy.client(None).prefault(self.layout.block_bytes, blocks)
        except StoreError as error:
            log.warning("kmesh store: no segments made ready at start: %s", error)
            return
        log.info("kmesh store: %d segments of %d bytes ready", warm, self.layout.block_bytes)

    def load(
        self, request_id: str, tracked: Tracked, first: int, loadable: int, idle: bool
    ) -> Acquired | None:
        """The store's hits for the request's blocks from `first` on (all it leads after them
        recorded); None while it waits for another engine's block before `loadable`. `idle`:
        nothing of this engine runs."""
        keys = [bytes(k) for k in tracked.keys[first:]]
        idle_wait = IDLE_WAIT_S if idle else 0.0
        got = self.policy.acquire(
            request_id, tracked.tenant, keys, first, loadable, _load_pin(request_id), idle_wait
        )
        return None if got is None else self._pin_trunk(tracked, got)

    def load_base(
        self, request_id: str, tracked: Tracked, first: int, base_blocks: int
    ) -> Acquired | None:
        """An activated request's base blocks first..base_blocks: the store's hits (it leads the
        rest); None (ask again next step) while another request of this engine fills the first
        base block it lacks. Another engine's claims are not waited for."""
        keys = [bytes(k) for k in tracked.keys[first:base_blocks]]
        got = self.policy.acquire(
            request_id, tracked.tenant, keys, first, first, _load_pin(request_id)
        )
        assert got is not None  # nothing before `first` is waited for
        got = self._pin_trunk(tracked, got)
        if first + len(got.hits) < base_blocks:
            owner = self.policy.owner(tracked.tenant, keys[len(got.hits)])
            if owner not in (None, request_id) and self.policy.may_wait(request_id):
                return None
        return got

    def led(self, request_id: str) -> dict[int, bytes]:
        """Block index -> key, of the blocks the request leads and has not saved yet."""
        return self.policy.led(request_id)

    def reserve(
        self, request_id: str, tracked: Tracked, done_tokens: int, block_ids: list[int]
    ) -> list[SaveBlock]:
        """Reserve segments for the led blocks vLLM has computed (`done_tokens`); the worker
        copies them there."""
        saves: list[SaveBlock] = []
        for index, key in self.policy.take_ready(request_id, done_tokens // self.block_size):
            try:
                segment = self.policy.client(tracked.tenant).reserve(key, self.layout.block_bytes)
            except StoreRefused as refused:
                log.info("kmesh store: keeping block %d local: %s", index, refused)
                self.policy.done(tracked.tenant, key)
                continue
            except StoreError as error:
                self.policy.failed(None, error)
                return saves
            params, in_trunk = tracked.params, index < tracked.trunk_blocks
            family = params.family if params is not None and in_trunk else None
            self._reserved[(tracked.tenant, key)] = family
            saves.append(SaveBlock(tracked.tenant, block_ids[index], key, segment))
        return saves

    def saved(self, saved: dict[TenantKey, int | None]) -> None:
        """The worker's copies: commit each with its checksum, or abandon it (None)."""
        for (tenant, key), crc in saved.items():
            self.policy.done(tenant, key)
            family = self._reserved.pop((tenant, key), None)
            if not self.available:
                continue
            try:
                client = self.policy.client(tenant)
                if crc is None:
                    client.abandon([key])
                else:
                    client.commit(key, crc, self.meta_bytes, family)
            except StoreRefused as refused:
                log.info("kmesh store: block not published: %s", refused)
            except StoreError as error:
                self.policy.failed(None, error)

    def finish(self, request_id: str, tracked: Tracked) -> None:
        """The request ended: abandon what it led and did not save, unpin its loads, and end
        its family membership (closing the pins of families that end)."""
        self.policy.release(request_id)
        if tracked.params is None:
            return
        if not self.available:  # the store is gone, and its pins with it
            self.pins.families.end_member(tracked.params, tracked.tenant)
            return
        try:
            self.pins.end_member(tracked.params, tracked.tenant)
        except StoreError as error:
            self.policy.failed(None, error)

    def close(self) -> None:
        self.policy.close()

    def pin_transcript(self, tracked: Tracked, keys: Sequence[bytes]) -> None:
        """Pin a member's transcript entries for its family at its declared next use."""
        params = tracked.params
        if params is None or params.family is None or params.next_use is None:
            return
        if not self.available:
            return
        try:
            self.pins.pin(params.family, tracked.tenant, keys, params.next_use)
        except StoreError as error:
            self.policy.failed(None, error)

    def _pin_trunk(self, tracked: Tracked, got: Acquired) -> Acquired:
        """Pin the request's family trunk; `got`, or no hits if the store is gone now."""
        params = tracked.params
        if tracked.trunk_blocks and params is not None and params.family and self.available:
            trunk = [bytes(k) for k in tracked.keys[: tracked.trunk_blocks]]
            try:
                self.pins.pin(params.family, tracked.tenant, trunk)
            except StoreError as error:
                self.policy.failed(None, error)
        return got if self.available else Acquired((), (), None, got.lease)


def _load_pin(request_id: str) -> str:
    """The store family that pins a request's hits until it finishes."""
    return f"kmesh-load:{request_id}"
