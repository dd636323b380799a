"""The store's wire protocol: versioned messages and the entry checksum.

A connection carries frames (framing.py), each holding one MessagePack map (encoded with
`msgspec.msgpack`). The client sends one request and reads one answer; the store answers
requests of a connection in order, and answers an `acquire` that waits only when the wait is over
(see docs/reference/store-protocol.md).

Every map carries `op` (the message type) and `v` (PROTOCOL_VERSION); a request also carries
`tenant`. The store decodes a request in two steps, so that a client of another version gets a
clear `bad_version` error rather than a complaint about fields: first the envelope (`v`, `op`),
then the whole message, strictly (unknown fields, wrong types and out-of-range values are
refused). Tensor bytes never travel on the socket: answers name shared memory segments.

The checksum of an entry is CRC-32 (zlib) over its key, its metadata and its payload: it is there to
catch accidental corruption (a stray write, a torn segment, a mix-up of segments), which CRC-32
detects at several GB/s, four times the speed of BLAKE2b here. It is not a defence against a
hostile process: anything that can map a segment can also rewrite its checksum's inputs.
"""

import zlib
from typing import TYPE_CHECKING, Annotated, Final, get_args

import msgspec

from kmesh.errors import KMeshError

if TYPE_CHECKING:
    from typing_extensions import Buffer

PROTOCOL_VERSION: Final = 1
KEY_BYTES: Final = 32
MAX_KEYS: Final = 1024  # keys per request: a hit costs < 600 bytes, so answers fit in a frame
MAX_META_BYTES: Final = 512
MAX_NAME_CHARS: Final = 256  # tenants, families and segment names
MAX_WAIT_S: Final = 3600.0

Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Meta = Annotated[bytes, msgspec.Meta(max_length=MAX_META_BYTES)]
Checksum = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]


class ProtocolError(KMeshError):
    """A frame or message that breaks the protocol; `code` names the kind (see ERROR_CODES)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


ERROR_CODES: Final = {
    "bad_frame": "the frame's length prefix is zero or above MAX_FRAME_BYTES (connection closed)",
    "bad_request": "the frame is not a valid message of its type",
    "bad_version": "the request's protocol version is not this store's",
    "unknown_op": "the request's type is not one the store knows",
    "internal": "the store failed on this request (connection closed)",
    "unauthorized": "the store takes API keys: a connection's first request must be a hello with "
    "a key it knows",
}


# Requests (client -> store).


# When a family reads an entry next: an ordinal or a time, smaller is sooner (None: any time).
NextUse = Annotated[float, msgspec.Meta(ge=0.0, le=1e18)] | None


class Request(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", kw_only=True
):
    """Every request names its protocol version and the client's tenant (None: shared)."""

    v: int = PROTOCOL_VERSION  # required on the wire: the envelope has no default
    tenant: Name | None


class Acquire(Request, frozen=True, tag="acquire"):
    """Look up a chain of keys; claim the missing ones or wait for their leader."""

    keys: Keys
    wait: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)] = 0.0
    family: Name | None = None


class Lookup(Request, frozen=True, tag="lookup"):
    """Which of `keys` are published, each on its own (not as a chain); claims nothing."""

    keys: Keys


class Reserve(Request, frozen=True, tag="reserve"):
    """The leader of `key` asks for a segment of `size` bytes to write its payload into."""

    key: Key
    size: Annotated[int, msgspec.Meta(ge=1)]


class Commit(Request, frozen=True, tag="commit"):
    """The leader of `key` makes its written segment visible."""

    key: Key
    checksum: Checksum
    meta: Meta = b""
    family: Name | None = None
    next_use: NextUse = None


class Abandon(Request, frozen=True, tag="abandon"):
    """Give up the claims on `keys` (those this connection holds)."""

    keys: Keys


class Pin(Request, frozen=True, tag="pin"):
    """Pin the published entries of `keys` for `family` until the family is closed, declaring
    when the family reads them next (`next_use`, kmesh/coord/future_use.py; None: any time)."""

    family: Name
    keys: Keys
    next_use: NextUse = None


class CloseFamily(Request, frozen=True, tag="close_family"):
    family: Name


class Drop(Request, frozen=True, tag="drop"):
    """Report entry `key`, read from segment `name`, as corrupt: the store forgets it."""

    key: Key
    name: Name


class Stats(Request, frozen=True, tag="stats"):
    pass


class Ping(Request, frozen=True, tag="ping"):
    """Renew this connection's leases."""


class Prefault(Request, frozen=True, tag="prefault"):
    """Make up to `count` spare segments of `size` bytes for the client to fault in (tier.py:
    spares); answered with their names."""

    size: Annotated[int, msgspec.Meta(ge=1)]
    count: Annotated[int, msgspec.Meta(ge=0, le=MAX_KEYS)]


class Warmed(Request, frozen=True, tag="warmed"):
    """These spares' pages are faulted in: reservations of their size may take them."""

    names: Annotated[list[Name], msgspec.Meta(max_length=MAX_KEYS)]


class Hello(Request, frozen=True, tag="hello"):
    """The connection's API key (a store with --api-keys needs it first): every later request
    of the connection is its key's tenant's, `tenant` then naming a namespace within it."""

    key: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]


AnyRequest = (
    Acquire
    | Lookup
    | Reserve
    | Commit
    | Abandon
    | Pin
    | CloseFamily
    | Drop
    | Stats
    | Ping
    | Prefault
    | Warmed
    | Hello
)
REQUEST_OPS: Final = frozenset(str(t.__struct_config__.tag) for t in get_args(AnyRequest))


# Answers (store -> client).


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    v: int = PROTOCOL_VERSION


class HitInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # shared memory segment
    size: int
    checksum: int
    meta: bytes


class Acquired(Answer, frozen=True, tag="acquired"):
    """keys[:len(hits)] are published; then this connection leads keys[len(hits):][:lead], or,
    if `wait`, keys[len(hits)] is being computed by another client (and a wait, if one was asked
    for, ran out)."""

    hits: list[HitInfo] = []
    lead: int = 0
    wait: bool = False
    lease: float = 0.0


class Found(Answer, frozen=True, tag="found"):
    """The indices, in the request's `keys`, of the published ones."""

    present: list[int] = []


class Reserved(Answer, frozen=True, tag="reserved"):
    name: str = ""


class Spares(Answer, frozen=True, tag="spares"):
    names: list[str] = []


class Refused(Answer, frozen=True, tag="refused"):
    """An expected refusal: code is too_large, full, no_memory, not_leader or not_reserved."""

    code: str = ""
    reason: str = ""


class Done(Answer, frozen=True, tag="done"):
    count: int = 0


class StatsInfo(Answer, frozen=True, tag="stats"):
    capacity: int = 0
    used: int = 0
    entries: int = 0
    pinned: int = 0
    reserved: int = 0
    spares: int = 0
    claims: int = 0
    waiters: int = 0
    connections: int = 0
    hits: int = 0
    misses: int = 0
    published: int = 0
    evicted: int = 0
    dropped: int = 0
    refused: int = 0
    promoted: int = 0
    expired: int = 0
    remote_fetched: int = 0  # entries copied from the remote tier
    remote_claimed: int = 0  # remote claims taken (keys computed on this machine for all)
    remote_busy: int = 0  # keys found being computed on another machine
    remote_failed: int = 0  # keys the remote tier could not answer for (computed here)
    remote_written: int = 0  # entries written through to the remote tier
    remote_refused: int = 0  # write-throughs the remote tier refused (full) or failed
    remote_pending: int = 0  # write-throughs not done yet


class Error(Answer, frozen=True, tag="error"):
    code: str = ""
    message: str = ""


AnyAnswer = Acquired | Found | Reserved | Spares | Refused | Done | StatsInfo | Error


class _Envelope(msgspec.Struct):
    v: int
    op: str


_envelope = msgspec.msgpack.Decoder(_Envelope)
_requests = msgspec.msgpack.Decoder(AnyRequest)
_answers = msgspec.msgpack.Decoder(AnyAnswer)


def decode_request(body: bytes) -> AnyRequest:
    """A request, checked: envelope, version and type first, then every field."""
    try:
        envelope = _envelope.decode(body)
    except msgspec.DecodeError as error:
        raise ProtocolError(
            "bad_request", f"not a request map with `v` and `op`: {error}"
        ) from None
    if envelope.v != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"protocol version {envelope.v} is not supported; this store speaks version "
            f"{PROTOCOL_VERSION}",
        )
    if envelope.op not in REQUEST_OPS:
        raise ProtocolError(
            "unknown_op",
            f"unknown message type {envelope.op[:64]!r}; known: {', '.join(sorted(REQUEST_OPS))}",
        )
    try:
        return _requests.decode(body)
    except msgspec.DecodeError as error:
        raise ProtocolError("bad_request", f"invalid {envelope.op!r} request: {error}") from None


def decode_answer(body: bytes) -> AnyAnswer:
    try:
        answer = _answers.decode(body)
    except msgspec.DecodeError as error:
        raise ProtocolError("bad_request", f"invalid answer from the store: {error}") from None
    if answer.v != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"the store speaks protocol version {answer.v}, this client {PROTOCOL_VERSION}",
        )
    return answer


def checksum(key: bytes, meta: bytes, *payload: "Buffer") -> int:
    """CRC-32 of key, metadata and payload, chained (the payload is read in place, not copied);
    a payload given in parts is checksummed as their concatenation."""
    crc = zlib.crc32(meta, zlib.crc32(key))
    for part in payload:
        crc = zlib.crc32(part, crc)
    return crc
