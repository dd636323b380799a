"""The store's client: what an engine calls to share keyed state with other processes.

A client works on chains of block keys (a prompt's full blocks, each key standing for its whole
prefix, e.g. kmesh.state.keys.block_key). One round trip per call, on one Unix socket
(connection.py); payloads never cross the socket: a hit names a shared memory segment that `read`
maps, and `publish` writes straight into a segment the store reserved. The intended use:

    with StoreClient(socket_path, tenant=namespace.tenant_salt) as store:
        got = store.acquire(keys, family=family_id)
        if got.waiting_on is not None:  # another client computes the next block: let it
            got = store.wait(keys, timeout=30.0, family=family_id)
        for hit in got.hits:  # keys[:len(hits)]
            with store.read(hit) as entry:  # checksum verified; EntryLost: recompute instead
                restore(entry.data, entry.meta)  # copy out, then drop views before the close
        ...compute the other blocks...
        for key in got.lead:  # the blocks this client must publish (or abandon)
            store.publish(key, block_bytes(key), meta={"dtype": "float32"}, family=family_id)
        store.close_family(family_id)  # when the family ends: its entries become evictable

If `wait` ran out, `waiting_on` is still set and `lead` empty: compute without the store. Every
failure to use the store is a StoreError (errors.py): the fallback is always "compute it here".

A leader must publish or abandon each led key before its lease (Acquired.lease seconds) runs
out; any request, `renew()` included, renews it. A client is one connection: not thread-safe,
and its claims, pins and families end with it (`holding` says whether it has any). With `key`
(a store started with --api-keys; engines take it from the KMESH_STORE_KEY environment
variable) it says hello first, and its tenant is then a namespace within the key's tenant.
"""

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kmesh.store.closing import Closing
from kmesh.store.connection import Connection
from kmesh.store.errors import EntryLost, StoreError, StoreRefused
from kmesh.store.hits import Acquired, Hit, check_key, check_keys, check_name
from kmesh.store.holdings import Holdings
from kmesh.store.protocol import (
    MAX_KEYS,
    MAX_WAIT_S,
    Abandon,
    Acquire,
    AnyAnswer,
    AnyRequest,
    CloseFamily,
    Commit,
    Done,
    Drop,
    Found,
    Hello,
    Lookup,
    Pin,
    Ping,
    Prefault,
    Refused,
    Reserve,
    Reserved,
    Spares,
    Stats,
    StatsInfo,
    Warmed,
    checksum,
)
from kmesh.store.protocol import Acquired as AcquiredAnswer
from kmesh.store.segments import (
    Mapped,
    decode_meta,
    encode_meta,
    map_segment,
    touch_segments,
    write_segment,
)

# The API key engines give a store started with --api-keys.
STORE_KEY_ENV = "KMESH_STORE_KEY"

if TYPE_CHECKING:
    from typing_extensions import Buffer


def _short(key: bytes) -> str:
    return key.hex()[:16]


class StoreClient(Closing):
    """One connection to a store, on behalf of one tenant (None: the shared namespace)."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        tenant: str | None = None,
        timeout: float = 5.0,
        key: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.socket_path = os.fspath(socket_path)
        self.tenant = None if tenant is None else check_name("tenant", tenant)
        self.timeout = timeout
        self._connection = Connection(self.socket_path, timeout)
        self._holdings = Holdings()
        if key is not None:
            self._count(Hello(key=key, tenant=self.tenant))

    @property
    def holding(self) -> bool:
        """Whether closing this client would let go of something the store ties to its
        connection: a family's pins (pin, or acquire/commit with a family, until close_family)
        or a claim it leads (from acquire/wait until commit, abandon, a refused reserve, or its
        lease running out with no request from this client; its reservation goes with it). A
        read's mapping is not the connection's (a closed client's reads stay valid)."""
        if self._connection.closed:
            return False
        return self._holdings.any()

    def acquire(self, keys: Sequence[bytes], family: str | None = None) -> Acquired:
        """Hits for the published prefix of `keys`, then either the keys this client now leads
        or the key it would wait for. With `family`, the hits are pinned for it."""
        return self._acquire(keys, 0.0, family)

    def wait(self, keys: Sequence[bytes], timeout: float, family: str | None = None) -> Acquired:
        """Like acquire, but while another client leads the first missing key, wait (up to
        `timeout` seconds) until it publishes it (then go on down the chain) or goes away (then
        this client may be the one promoted to lead)."""
        if not 0 <= timeout <= MAX_WAIT_S:
            raise ValueError(f"timeout must be within 0..{MAX_WAIT_S} seconds, got {timeout}")
        return self._acquire(keys, timeout, family)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The indices in `keys` of the published ones, each looked up on its own (a probe of
        candidate keys); claims, pins and waits for nothing."""
        answer = self._call(Lookup(check_keys(keys), tenant=self.tenant))
        if not isinstance(answer, Found) or any(not 0 <= i < len(keys) for i in answer.present):
            raise self._connection.unexpected(answer)
        return answer.present

    def read(self, hit: Hit) -> Mapped:
        """Map a hit's bytes and check them against its checksum (CRC-32, see protocol.py).
        A mismatch is reported to the store, which drops the entry; both raise EntryLost."""
        try:
            mapping = map_segment(hit.name)
        except OSError as error:
            raise EntryLost(
                f"entry {_short(hit.key)} is gone (evicted, dropped or the store stopped): {error}"
            ) from None
        data = memoryview(mapping)[: hit.size]
        meta: dict[str, Any] | None = None
        if data.nbytes == hit.size and checksum(hit.key, hit.meta_bytes, data) == hit.checksum:
            meta = decode_meta(hit.meta_bytes)
        if meta is None:
            data.release()
            mapping.close()
            self.drop(hit)
            raise EntryLost(
                f"entry {_short(hit.key)} failed its checksum; the store dropped it, compute it "
                "again"
            )
        return Mapped(hit.key, mapping, data, meta)

    def publish(
        self,
        key: bytes,
        payload: "Buffer",
        meta: Mapping[str, Any] | None = None,
        family: str | None = None,
        next_use: float | None = None,
    ) -> None:
        """Publish a led key's payload (any C-contiguous buffer, e.g. a numpy array); see
        publish_into."""
        source = memoryview(payload).cast("B")
        self.publish_into(key, source.nbytes, [source], meta, family, next_use)

    def publish_into(
        self,
        key: bytes,
        size: int,
        chunks: Iterable["Buffer"],
        meta: Mapping[str, Any] | None = None,
        family: str | None = None,
        next_use: float | None = None,
    ) -> None:
        """Publish a led key: the store reserves `size` bytes of shared memory, `chunks` fill
        them one after another (write_segment; an iterable may make each as it is written),
        then the entry is committed with its checksum and only then becomes visible. `meta` is
        a small map returned with every read (dtype, shape...). With `family`, the entry is
        pinned for it (`next_use`: see `pin`).
        StoreRefused if the store cannot fit it even after eviction (or the claim is gone); if
        writing raises, the key is abandoned."""
        if family is not None:
            check_name("family", family)
        meta_bytes = encode_meta(meta)
        name = self.reserve(key, size)
        try:
            crc = write_segment(name, key, size, meta_bytes, chunks)
        except BaseException:
            with contextlib.suppress(StoreError):
                self.abandon([key])
            raise
        self.commit(key, crc, meta_bytes, family, next_use)

    def reserve(self, key: bytes, size: int) -> str:
        """Reserve `size` bytes of shared memory for a led key; returns the segment's name, to
        fill with write_segment (in this process or another) and then `commit`. StoreRefused if
        it cannot fit even after eviction (the claim is then released) or the claim is gone."""
        key = check_key(key)
        if size < 1:
            raise ValueError(f"a payload needs at least one byte, got size {size}")
        answer = self._call(Reserve(key, size, tenant=self.tenant))
        if isinstance(answer, Refused):  # the claim was released, or was not this client's
            self._holdings.let_go((key,))
            raise StoreRefused(answer.code, answer.reason)
        if not isinstance(answer, Reserved):
            raise self._connection.unexpected(answer)
        return answer.name

    def commit(
        self,
        key: bytes,
        crc: int,
        meta_bytes: bytes = b"",
        family: str | None = None,
        next_use: float | None = None,
    ) -> None:
        """Make a reserved, written key visible; `crc` is what write_segment returned and
        `meta_bytes` what encode_meta gave it. With `family`, the entry is pinned for it (its
        next use declared: see `pin`)."""
        key = check_key(key)
        if family is not None:
            check_name("family", family)
        request = Commit(key, crc, meta_bytes, family, next_use, tenant=self.tenant)
        answer = self._call(request)
        if isinstance(answer, Refused):
            if answer.code == "not_leader":
                self._holdings.let_go((key,))
            raise StoreRefused(answer.code, answer.reason)
        if not isinstance(answer, Done):
            raise self._connection.unexpected(answer)
        self._holdings.let_go((key,))
        if family is not None:
            self._holdings.families.add(family)

    def abandon(self, keys: Sequence[bytes]) -> int:
        """Give up leading `keys` (waiters get promoted); returns how many were led."""
        checked = check_keys(keys)
        count = self._count(Abandon(checked, tenant=self.tenant))
        self._holdings.let_go(checked)
        return count

    def pin(self, family: str, keys: Sequence[bytes], next_use: float | None = None) -> int:
        """Declare that `family` reads the published entries of `keys` again, at `next_use` (an
        ordinal or a time, smaller is sooner; None: any time), until `close_family(family)` or
        this client closes: the store evicts them last (kmesh/coord/future_use.py); returns how
        many are pinned."""
        family = check_name("family", family)
        count = self._count(Pin(family, check_keys(keys), next_use, tenant=self.tenant))
        if count:
            self._holdings.families.add(family)
        return count

    def close_family(self, family: str) -> int:
        """Release the family's pins; returns how many entries it had pinned."""
        count = self._count(CloseFamily(check_name("family", family), tenant=self.tenant))
        self._holdings.families.discard(family)
        return count

    def drop(self, hit: Hit) -> bool:
        """Report a hit's entry as bad: the store forgets it (if it is still that entry)."""
        return self._count(Drop(hit.key, hit.name, tenant=self.tenant)) > 0

    def renew(self) -> None:
        """Renew this client's leases."""
        self._count(Ping(tenant=self.tenant))

    def prefault(self, size: int, count: int) -> int:
        """Have the store make up to `count` spare segments of `size` bytes (as many as its free
        room holds) and fault them in from here, so that later reservations of that size are
        written at memory speed (tier.py: spares); how many are warm. Call it at start."""
        if size < 1:
            raise ValueError(f"a spare needs at least one byte, got size {size}")
        warm = 0
        while count > 0:
            answer = self._call(Prefault(size, min(count, MAX_KEYS), tenant=self.tenant))
            if not isinstance(answer, Spares):
                raise self._connection.unexpected(answer)
            touched = touch_segments(answer.names, size)
            warm += self._count(Warmed(touched, tenant=self.tenant))
            if len(answer.names) < min(count, MAX_KEYS):
                break  # the store's free room is spent
            count -= len(answer.names)
        return warm

    def stats(self) -> dict[str, int]:
        """The store's counters (capacity and bytes used are the whole store's)."""
        answer = self._call(Stats(tenant=self.tenant))
        if not isinstance(answer, StatsInfo):
            raise self._connection.unexpected(answer)
        return {k: v for k, v in msgspec.structs.asdict(answer).items() if k != "v"}

    def close(self) -> None:
        self._connection.close()
        self._holdings.clear()

    def _call(self, request: AnyRequest, wait: float = 0.0) -> AnyAnswer:
        """The store's answer; the request renewed this client's lease (from the store's
        receipt, which is no later than now)."""
        answer = self._connection.call(request, wait)
        self._holdings.renewed()
        return answer

    def _acquire(self, keys: Sequence[bytes], wait: float, family: str | None) -> Acquired:
        checked = check_keys(keys)
        if family is not None:
            check_name("family", family)
        request = Acquire(checked, wait=wait, family=family, tenant=self.tenant)
        answer = self._call(request, wait)
        if not isinstance(answer, AcquiredAnswer):
            raise self._connection.unexpected(answer)
        found = len(answer.hits)
        if found + answer.lead > len(checked) or (
            answer.wait and (answer.lead or found == len(checked))
        ):
            raise self._connection.unexpected(answer)
        self._holdings.leading(checked[found : found + answer.lead], answer.lease)
        if family is not None and found:
            self._holdings.families.add(family)
        return Acquired(
            hits=tuple(
                Hit(key, h.name, h.size, h.checksum, h.meta)
                for key, h in zip(checked, answer.hits, strict=False)
            ),
            lead=tuple(checked[found : found + answer.lead]),
            waiting_on=checked[found] if answer.wait else None,
            lease=answer.lease,
        )

    def _count(self, request: AnyRequest) -> int:
        answer = self._call(request)
        if not isinstance(answer, Done):
            raise self._connection.unexpected(answer)
        return answer.count
