"""The remote tier's bytes: entries and claim records in Mooncake Store, shared by the stores of
several machines. I/O only; what to do with it is worker.py's and front.py's.

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
  Records go to the claimer's own lent memory when it lends some (Mooncake's preferred segment):
  they die with it, and a take never lands in a dead lender's memory.
Joining raises RemoteUnavailable if the master or its metadata server does not answer; after
that, every call answers None / False / empty on a Mooncake error and never raises for one;
`error` keeps the last error's text.
"""

import hashlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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


def _check_reachable(what: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except (OSError, ValueError) as error:
        raise RemoteUnavailable(
            f"cannot join the Mooncake Store: its {what} at {address} does not answer ({error}); "
            "start mooncake_master there with --enable_http_metadata_server=true"
        ) from None


def _record(value: bytes, generation: int) -> ClaimRecord:
    """The claim record in `value`; one nobody beats if it cannot be read."""
    try:
        record = msgspec.msgpack.decode(value, type=ClaimRecord) if value else None
    except msgspec.DecodeError:
        record = None
    if record is None:
        return ClaimRecord("", -1, False, generation)
    return msgspec.structs.replace(record, generation=generation)


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

        for what, address in (("master", master), ("metadata server", urlsplit(metadata).netloc)):
            _check_reachable(what, address)  # Mooncake itself retries for minutes
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
        self._claims = ReplicateConfig()  # in this machine's own memory, if it lends some:
        if lend > 0:  # then a record dies with its holder, and a take never lands in dead memory
            self._claims.preferred_segment = self._store.get_hostname()
        self._soft_pinned = ReplicateConfig()
        self._soft_pinned.soft_pin_action = type(self._soft_pinned.soft_pin_action).ENABLE

    def present(self, idents: Sequence[EntryId]) -> list[bool] | None:
        """Which entries exist (None: the tier did not answer)."""
        return self._exist([entry_name(ident) for ident in idents])

    def get(self, idents: Sequence[EntryId]) -> list[RemoteEntry | None]:
        """The entries, checked (a value that fails the checks is removed); None where absent."""
        if not idents:
            return []
        names = [entry_name(ident) for ident in idents]
        entries: list[RemoteEntry | None] = []
        for ident, name, value in zip(idents, names, self._store.get_batch(names), strict=True):
            entry = decode_entry(ident, value) if value else None
            if value and entry is None:
                self.error = f"{name} failed its checks; removed"
                self._store.remove(name, True)
            entries.append(entry)
        return entries

    def put(self, ident: EntryId, payload: memoryview, crc: int, meta: bytes, pin: bool) -> bool:
        """Publish an entry (kept over unpinned ones under eviction when `pin`); False if the
        tier refused it (full) or failed."""
        value = encode_entry(ident, payload, crc, meta)
        config = self._soft_pinned if pin else self._plain
        return self._ok(self._store.put(entry_name(ident), value, config))

    def latest_claims(self, idents: Sequence[EntryId]) -> list[ClaimRecord | None] | None:
        """Each key's claim record of the highest generation, or None where it has none (None
        for all: the tier did not answer). A record that exists but cannot be read (the memory
        it was in is gone with its lender) reads as one nobody beats, so it runs out."""
        counts = [0] * len(idents)
        open_ = list(range(len(idents)))  # keys whose every generation looked at so far exists
        while open_:
            first = counts[open_[0]]
            names = [claim_name(idents[i], first + g) for i in open_ for g in range(_GENERATIONS)]
            found = self._exist(names)
            if found is None:
                return None
            still = []
            for n, i in enumerate(open_):
                mine = found[n * _GENERATIONS : (n + 1) * _GENERATIONS]
                counts[i] += mine.index(False) if False in mine else _GENERATIONS
                if all(mine):
                    still.append(i)
            open_ = still
        latest = [(i, count - 1) for i, count in enumerate(counts) if count]
        if not latest:
            return [None] * len(idents)
        values = self._store.get_batch([claim_name(idents[i], g) for i, g in latest])
        records: list[ClaimRecord | None] = [None] * len(idents)
        for (i, generation), value in zip(latest, values, strict=True):
            records[i] = _record(value, generation)
        return records

    def take_claims(self, claims: Sequence[tuple[EntryId, int]], holder: str) -> list[bool]:
        """Try to take each (key, generation): True where this holder's record is the one kept
        (`put` keeps the first writer's)."""
        if not claims:
            return []
        names = [claim_name(ident, generation) for ident, generation in claims]
        value = msgspec.msgpack.encode(ClaimRecord(holder))
        self._store.put_batch(names, [value] * len(names), self._claims)
        kept = self._store.get_batch(names)
        return [
            (record := _record(v, g)).holder == holder and not record.released
            for v, (_, g) in zip(kept, claims, strict=True)
        ]

    def beat(self, claims: Sequence[tuple[EntryId, int, int]], holder: str) -> bool:
        """Raise the beat of claims held here: (key, generation, beat)."""
        names = [claim_name(ident, generation) for ident, generation, _ in claims]
        values = [msgspec.msgpack.encode(ClaimRecord(holder, beat)) for _, _, beat in claims]
        return self._ok(self._store.upsert_batch(names, values, self._claims))

    def release_claim(self, ident: EntryId, generation: int, holder: str) -> bool:
        record = msgspec.msgpack.encode(ClaimRecord(holder, released=True))
        return self._ok(self._store.upsert(claim_name(ident, generation), record, self._claims))

    def forget_claims(self, ident: EntryId, through: int) -> None:
        """Remove claim records 0..through (the entry is published: they are history)."""
        self._store.batch_remove([claim_name(ident, g) for g in range(through + 1)], True)

    def close(self) -> None:
        self._store.close()

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
