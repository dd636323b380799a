"""The remote tier's bytes: entries and claim records in Mooncake Store, shared by the stores of
several machines. I/O only; what to do with it is remote_worker.py's and remote_front.py's.

Mooncake Store is a master holding object metadata and memory lent by its clients (each store
process lends `lend` bytes; a `mooncake_client` process can lend more). Objects are named by
strings; `put` never replaces an object (and answers 0 either way), `upsert` does, `get` of a
missing object answers b"".

- An entry (key, tenant) is the object `kmesh/e/<tenant digest>/<key hex>`: a header (msgpack:
  key, tenant, size, checksum, meta) after its 4-byte length, then the payload. A read checks
  that the header names the entry asked for, that the size matches and the CRC-32
  (protocol.checksum over key, meta, payload); a value that fails is removed and read as a miss.
- A claim on an entry is a record `kmesh/c/<tenant digest>/<key hex>/<generation>`: who holds
  it, a beat counter the holder raises while it lives, and whether it was released. The latest
  record is the one with the highest generation. To take generation g, a claimer puts its record
  and reads it back: `put` keeps the first writer's, so exactly one claimer reads its own.
Every call answers None / False / empty on a Mooncake error and never raises for one; `error`
keeps the last error's text.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kmesh.errors import KMeshError
from kmesh.store.protocol import checksum
from kmesh.store.tier import EntryId

_GENERATIONS = 8  # claim records looked at per call; more are read when all exist
_HEADER_LENGTH = 4


class RemoteUnavailable(KMeshError):
    """The Mooncake master cannot be reached or the client cannot be set up."""


class _Header(msgspec.Struct, frozen=True):
    key: bytes
    tenant: str | None
    size: int
    checksum: int
    meta: bytes


class ClaimRecord(msgspec.Struct, frozen=True):
    """A claim's state in the remote tier; `generation` is not stored (it is in the name)."""

    holder: str
    beat: int = 0
    released: bool = False
    generation: int = -1


@dataclass(frozen=True, slots=True)
class RemoteEntry:
    payload: bytes
    checksum: int
    meta: bytes


def _prefix(kind: str, ident: EntryId) -> str:
    key, tenant = ident
    space = "-" if tenant is None else hashlib.sha256(tenant.encode()).hexdigest()[:32]
    return f"kmesh/{kind}/{space}/{key.hex()}"


def entry_name(ident: EntryId) -> str:
    return _prefix("e", ident)


def claim_name(ident: EntryId, generation: int) -> str:
    return f"{_prefix('c', ident)}/{generation}"


def encode_entry(ident: EntryId, payload: bytes | memoryview, crc: int, meta: bytes) -> bytes:
    header = msgspec.msgpack.encode(_Header(ident[0], ident[1], len(payload), crc, meta))
    return len(header).to_bytes(_HEADER_LENGTH, "big") + header + payload


def decode_entry(ident: EntryId, value: bytes) -> RemoteEntry | None:
    """The entry in `value` if it is `ident`'s, whole and matching its checksum; else None."""
    try:
        length = int.from_bytes(value[:_HEADER_LENGTH], "big")
        header = msgspec.msgpack.decode(
            value[_HEADER_LENGTH : _HEADER_LENGTH + length], type=_Header
        )
    except msgspec.DecodeError:
        return None
    payload = value[_HEADER_LENGTH + length :]
    if (header.key, header.tenant) != ident or len(payload) != header.size:
        return None
    if checksum(header.key, header.meta, payload) != header.checksum:
        return None
    return RemoteEntry(payload, header.checksum, header.meta)


class MooncakeTier:
    """One Mooncake Store client (see the module docstring). Not thread-safe: one thread uses it."""

    def __init__(
        self,
        master: str,
        metadata: str,
        local_hostname: str,
        lend: int,
        buffer: int = 64 << 20,
    ) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.error = ""
        self._store: Any = MooncakeDistributedStore()
        code = self._store.setup(local_hostname, metadata, lend, buffer, "tcp", "", master)
        if code != 0:
            raise RemoteUnavailable(
                f"cannot join the Mooncake Store at master {master} (metadata {metadata}): "
                f"setup answered {code}; is mooncake_master running there with "
                "--enable_http_metadata_server=true?"
            )
        self._plain = ReplicateConfig()
        self._soft_pinned = ReplicateConfig()
        self._soft_pinned.soft_pin_action = type(self._soft_pinned.soft_pin_action).ENABLE

    def healthy(self) -> bool:
        return bool(self._store.health_check() == 0)

    def present(self, idents: Sequence[EntryId]) -> list[bool] | None:
        """Which entries exist (None: the tier did not answer)."""
        return self._exist([entry_name(ident) for ident in idents])

    def get(self, ident: EntryId) -> RemoteEntry | None:
        """The entry, checked (a value that fails the checks is removed); None if absent."""
        name = entry_name(ident)
        value = self._store.get(name)
        if not value:
            return None
        entry = decode_entry(ident, value)
        if entry is None:
            self.error = f"{name} failed its checks; removed"
            self._store.remove(name, True)
        return entry

    def put(self, ident: EntryId, payload: memoryview, crc: int, meta: bytes, pin: bool) -> bool:
        """Publish an entry (kept over unpinned ones under eviction when `pin`); False if the
        tier refused it (full) or failed."""
        config = self._soft_pinned if pin else self._plain
        return self._ok(
            self._store.put(entry_name(ident), encode_entry(ident, payload, crc, meta), config)
        )

    def latest_claim(self, ident: EntryId) -> ClaimRecord | None:
        """The claim record with the highest generation, or None (none, or no answer)."""
        first = 0
        while True:
            names = [claim_name(ident, g) for g in range(first, first + _GENERATIONS)]
            found = self._exist(names)
            if found is None:
                return None
            count = found.index(False) if False in found else _GENERATIONS
            if count < _GENERATIONS:
                break
            first += _GENERATIONS
        if first + count == 0:
            return None
        generation = first + count - 1
        # A record that exists but cannot be read (its memory's lender died) is a claim nobody
        # beats: it runs out like one.
        return self._record(ident, generation) or ClaimRecord("", -1, False, generation)

    def take_claim(self, ident: EntryId, generation: int, holder: str) -> bool:
        """Try to take claim `generation`: True if this holder's record is the one kept."""
        name = claim_name(ident, generation)
        self._store.put(name, msgspec.msgpack.encode(ClaimRecord(holder)), self._plain)
        record = self._record(ident, generation)
        return record is not None and record.holder == holder

    def beat(self, ident: EntryId, generation: int, holder: str, beat: int) -> bool:
        record = ClaimRecord(holder, beat)
        return self._ok(
            self._store.upsert(
                claim_name(ident, generation), msgspec.msgpack.encode(record), self._plain
            )
        )

    def release_claim(self, ident: EntryId, generation: int, holder: str) -> bool:
        record = ClaimRecord(holder, released=True)
        return self._ok(
            self._store.upsert(
                claim_name(ident, generation), msgspec.msgpack.encode(record), self._plain
            )
        )

    def forget_claims(self, ident: EntryId, through: int) -> None:
        """Remove claim records 0..through (the entry is published: they are history)."""
        for generation in range(through + 1):
            self._store.remove(claim_name(ident, generation), True)

    def close(self) -> None:
        self._store.close()

    def _record(self, ident: EntryId, generation: int) -> ClaimRecord | None:
        value = self._store.get(claim_name(ident, generation))
        if not value:
            return None
        try:
            record = msgspec.msgpack.decode(value, type=ClaimRecord)
        except msgspec.DecodeError:
            return None
        return msgspec.structs.replace(record, generation=generation)

    def _exist(self, names: list[str]) -> list[bool] | None:
        answers = self._store.batch_is_exist(names)
        if any(answer < 0 for answer in answers):
            self.error = f"is_exist answered {min(answers)}"
            return None
        return [answer == 1 for answer in answers]

    def _ok(self, code: int) -> bool:
        if code != 0:
            self.error = f"Mooncake answered {code}"
        return code == 0
