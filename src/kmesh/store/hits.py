"""What a store client hands back (a published entry's Hit, an acquire's Acquired), and the
checks of what it sends (keys, names) against the protocol's limits, before any round trip."""

from collections.abc import Sequence
from dataclasses import dataclass

from kmesh.store.protocol import KEY_BYTES, MAX_KEYS, MAX_NAME_CHARS


@dataclass(frozen=True, slots=True)
class Hit:
    """A published entry of one key: where it lives and what its bytes must hash to."""

    key: bytes
    name: str  # shared memory segment
    size: int
    checksum: int
    meta_bytes: bytes  # MessagePack of the publisher's meta, checked with the payload


@dataclass(frozen=True, slots=True)
class Acquired:
    """The answer to acquire/wait for keys k: hits are k[:len(hits)]; this client leads `lead`
    (the keys right after the hits it must publish or abandon); `waiting_on`, if set, is the
    key after the hits that another client is computing."""

    hits: tuple[Hit, ...]
    lead: tuple[bytes, ...]
    waiting_on: bytes | None
    lease: float  # seconds a leader has to publish (any request renews it)


def check_key(key: bytes) -> bytes:
    """`key` as bytes, if it is a store key (a SHA-256 digest); else ValueError."""
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ValueError(f"a store key is {KEY_BYTES} bytes (a SHA-256 digest), got {key!r:.80}")
    return bytes(key)


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Keys for one request: at most MAX_KEYS, each a store key."""
    if len(keys) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per request, got {len(keys)}")
    return [check_key(key) for key in keys]


def check_name(what: str, name: str) -> str:
    """`name` (a tenant's, a family's), if the protocol takes its length; else ValueError."""
    if not 0 < len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"{what} must have 1 to {MAX_NAME_CHARS} characters, got {name!r:.80}")
    return name
