"""One engine's per-request store policy: acquire -> wait -> lead -> publish or abandon, and the
store dropped once it is unavailable. The reference engine (engine/block_store.py) and vLLM's
scheduler half (vllm/store_side.py) both follow it; they differ only in how bytes move.

For one request and the chain of its block keys from block `first` on:
- `acquire` answers the published prefix (hits, to restore) and records the blocks after it that
  the request now leads: at most one request of this engine leads a key (`owner`);
- while another engine computes the next block the request may still load, `acquire` answers None
  (ask again later), for at most `max_wait_s` from the request's first wait; then it takes what is
  published and computes the rest, leading nothing. With `idle_wait_s` it first waits that long in
  the store (an engine with nothing else to run). With `family`, its hits are pinned for that
  family until the request ends (so none is evicted before it is loaded);
- the led blocks, once computed, are taken by `take_ready` to be published (then `done`); what a
  request still leads when it ends is abandoned by `release`, so a waiter in the store takes over;
- every StoreError means computing instead (`failed`): a StoreUnavailable drops the store for the
  rest of the engine's life (`available` false, connections closed, claims forgotten); any other
  gives up the request's claims.
A request is any hashable the engine names it by. No tensors.
"""

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kmesh.store.client import StoreClient
from kmesh.store.errors import StoreError, StoreUnavailable
from kmesh.store.hits import Acquired
from kmesh.store.tenant_clients import TenantClients

log = logging.getLogger(__name__)

# (tenant salt, key): entries are filed per tenant in the store.
TenantKey = tuple[str | None, bytes]


@dataclass(slots=True)
class _Request:
    tenant: str | None
    led: dict[int, bytes] = field(default_factory=dict)  # block index -> key it leads
    waiting_since: float | None = None
    pinned: str | None = None  # the family its hits are pinned for, once some are


class StorePolicy:
    """The per-request policy over one store socket (see the module docstring)."""

    def __init__(self, socket_path: str | None, max_wait_s: float) -> None:
        self.available = socket_path is not None
        self.max_wait_s = max_wait_s
        self.lease = 60.0  # the store's, from its last answer
        # Without a socket never used (it would be unavailable).
        self._clients = TenantClients(socket_path or "")
        self._requests: dict[Hashable, _Request] = {}
        self._owner: dict[TenantKey, Hashable] = {}  # keys this engine leads -> the request

    def client(self, tenant: str | None) -> StoreClient:
        return self._clients(tenant)

    def acquire(
        self,
        request: Hashable,
        tenant: str | None,
        keys: Sequence[bytes],
        first: int,
        loadable: int,
        family: str | None = None,
        idle_wait_s: float = 0.0,
    ) -> Acquired | None:
        """Blocks first.. of the request (keys[i] is block first + i): the published prefix and
        the blocks it now leads; None while another engine computes a block before `loadable`
        and the request may still wait. With `family`, the hits are pinned for it."""
        empty = Acquired((), (), None, self.lease)
        if not self.available or not keys:
            return empty
        state = self._requests.setdefault(request, _Request(tenant))
        try:
            client = self.client(tenant)
            got = client.acquire(keys, family)
            state.pinned = family if got.hits else state.pinned
            if self._blocked(got, first, loadable) and self.may_wait(request):
                if idle_wait_s > 0:
                    got = client.wait(keys, timeout=idle_wait_s, family=family)
                    state.pinned = family if got.hits else state.pinned
                if self._blocked(got, first, loadable):
                    return None
        except StoreError as error:
            self.failed(request, error)
            return empty
        self.lease = got.lease
        self.claim(request, first + len(got.hits), got.lead)
        return got

    def claim(self, request: Hashable, start: int, keys: Sequence[bytes]) -> None:
        """The request leads blocks start.. (`keys`, as the store answered) unless another
        request of this engine already does."""
        state = self._requests[request]
        for index, key in enumerate(keys, start=start):
            if self._owner.setdefault((state.tenant, key), request) == request:
                state.led[index] = key

    def owner(self, tenant: str | None, key: bytes) -> Hashable | None:
        """The request of this engine that leads `key`, if any."""
        return self._owner.get((tenant, key))

    def may_wait(self, request: Hashable) -> bool:
        """Whether the request may still wait for another to compute its blocks (the clock
        starts at its first wait, and runs until the request ends)."""
        state = self._requests[request]
        if state.waiting_since is None:
            state.waiting_since = time.monotonic()
        return time.monotonic() - state.waiting_since < self.max_wait_s

    def led(self, request: Hashable) -> dict[int, bytes]:
        """Block index -> key, of the blocks the request leads and has not published yet."""
        state = self._requests.get(request)
        return {} if state is None else dict(state.led)

    @property
    def leading(self) -> bool:
        return any(state.led for state in self._requests.values())

    def take_ready(self, request: Hashable, num_blocks: int) -> list[tuple[int, bytes]]:
        """The led blocks among the request's first `num_blocks` (computed now), to publish;
        each then ends with `done`."""
        state = self._requests.get(request)
        if state is None or not self.available:
            return []
        ready = sorted(i for i in state.led if i < num_blocks)
        return [(i, state.led.pop(i)) for i in ready]

    def done(self, tenant: str | None, key: bytes) -> None:
        """A taken block is published, refused or given up: no request of this engine leads it."""
        self._owner.pop((tenant, key), None)

    def renew(self) -> None:
        """Renew the leases of the tenants whose requests lead blocks."""
        for tenant in {state.tenant for state in self._requests.values() if state.led}:
            self.client(tenant).renew()

    def abandon(self, request: Hashable) -> None:
        """Give up what the request leads and has not taken (a waiter in the store takes over);
        it computes those blocks itself."""
        state = self._requests.get(request)
        if state is None:
            return
        unpublished = [k for k in state.led.values() if self.owner(state.tenant, k) == request]
        state.led.clear()
        for key in unpublished:
            del self._owner[(state.tenant, key)]
        if unpublished and self.available:
            try:
                self.client(state.tenant).abandon(unpublished)
            except StoreError as error:
                self.failed(None, error)

    def release(self, request: Hashable) -> None:
        """The request ends (or is aborted): abandon what it leads and has not taken, unpin its
        hits, forget it."""
        self.abandon(request)
        state = self._requests.pop(request, None)
        if state is not None and state.pinned is not None and self.available:
            try:
                self.client(state.tenant).close_family(state.pinned)
            except StoreError as error:
                self.failed(None, error)

    def failed(self, request: Hashable | None, error: StoreError) -> None:
        """A store call failed: compute instead. Unavailable: drop the store for good; else
        the request (if named) gives up its claims."""
        if isinstance(error, StoreUnavailable):
            log.warning("kmesh store: unavailable, computing without it from now on: %s", error)
            self.available = False
            self._requests.clear()
            self._owner.clear()
            self.close()
        else:
            log.info("kmesh store: %s; computing instead", error)
            if request is not None:
                self.abandon(request)

    def close(self) -> None:
        self._clients.close()

    @staticmethod
    def _blocked(got: Acquired, first: int, loadable: int) -> bool:
        return got.waiting_on is not None and first + len(got.hits) < loadable
