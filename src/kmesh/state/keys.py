"""Typed, tagged state keys hashed with SHA-256.

A key is the digest of an ordered list of tagged parts. Each part is encoded with its tag, a
presence marker and a length prefix, so two different part lists can never encode to the same
bytes (no joined strings, no separator that a token or a salt could contain).
"""

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest identifying one full block of exact (position-bound) state."""

_BLOCK_KEY_VERSION = b"kmesh-block-key-v1"
_SEGMENT_KEY_VERSION = b"kmesh-segment-key-v1"
_PIECE_KEY_VERSION = b"kmesh-piece-key-v1"


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything besides tokens that the KV of a token depends on, or that must keep it apart."""

    # SHA-256 fingerprint of the model's weights and config (see compute.loader).
    model: str
    # Adapter name and path, or None for the base model: adapters change the KV of the same tokens.
    adapter: str | None = None
    # Tenant salt, or None for the shared namespace: state never crosses salts.
    tenant_salt: str | None = None


def encode_part(tag: str, value: bytes | None) -> bytes:
    """Encode one tagged part: tag length, tag, presence byte, then value length and value."""
    tag_bytes = tag.encode()
    head = struct.pack("<H", len(tag_bytes)) + tag_bytes
    if value is None:
        return head + b"\x00"
    return head + b"\x01" + struct.pack("<Q", len(value)) + value


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian unsigned 32-bit integers."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _optional_text(value: str | None) -> bytes | None:
    return None if value is None else value.encode()


def block_key(
    namespace: KeyNamespace, parent: BlockHash | None, token_ids: Sequence[int]
) -> BlockHash:
    """Key of one full block: namespace, the key of the block before it (None for the first) and
    its tokens. Chaining through the parent makes the key stand for the whole prefix."""
    return BlockHash(_chained_key(_BLOCK_KEY_VERSION, namespace, parent, token_ids))


def _chained_key(
    version: bytes, namespace: KeyNamespace, parent: bytes | None, token_ids: Sequence[int]
) -> bytes:
    """SHA-256 of a key kind's version tag, the namespace, the parent key and the tokens."""
    digest = hashlib.sha256(version)
    digest.update(encode_part("model", namespace.model.encode()))
    digest.update(encode_part("adapter", _optional_text(namespace.adapter)))
    digest.update(encode_part("tenant", _optional_text(namespace.tenant_salt)))
    digest.update(encode_part("parent", parent))
    digest.update(encode_part("tokens", encode_tokens(token_ids)))
    return digest.digest()


def extend_block_keys(
    keys: list[BlockHash], namespace: KeyNamespace, token_ids: Sequence[int], block_size: int
) -> None:
    """Append to `keys` (the chain of the first len(keys) blocks of `token_ids`) the keys of
    every further full block."""
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = keys[-1] if keys else None
        keys.append(block_key(namespace, parent, token_ids[start : start + block_size]))


def extend_adapter_block_keys(
    keys: list[BlockHash],
    base: KeyNamespace,
    adapted: KeyNamespace,
    token_ids: Sequence[int],
    block_size: int,
    adapter_start: int,
) -> None:
    """extend_block_keys for a request under an adapter that applies from token `adapter_start`
    on (0: a plain adapter): blocks wholly before it hold base-model state and are keyed in
    `base`, the rest in `adapted`, which must name the adapter and that start (the same tokens
    with the adapter starting elsewhere are other state). Both engines key LoRA requests so."""
    base_tokens = token_ids[: adapter_start // block_size * block_size]
    extend_block_keys(keys, base, base_tokens, block_size)
    extend_block_keys(keys, adapted, token_ids, block_size)


def activated_adapter(adapter: str, start: int) -> str:
    """The `adapter` part of keys for an activated adapter applying from token `start` on."""
    return f"{adapter}:from={start}"


def segment_key(namespace: KeyNamespace, token_ids: Sequence[int], context: str) -> bytes:
    """Key of a position-independent segment: namespace, its tokens and a tag naming the context
    its KV was computed in (the same tokens computed after different text have different KV)."""
    digest = hashlib.sha256(_SEGMENT_KEY_VERSION)
    digest.update(encode_part("model", namespace.model.encode()))
    digest.update(encode_part("adapter", _optional_text(namespace.adapter)))
    digest.update(encode_part("tenant", _optional_text(namespace.tenant_salt)))
    digest.update(encode_part("context", context.encode()))
    digest.update(encode_part("tokens", encode_tokens(token_ids)))
    return digest.digest()


def piece_key(namespace: KeyNamespace, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of a piece of held state (store/shared/group_state.py): namespace, the key of the piece
    before it (None for the first) and its tokens; like block_key, it stands for the whole
    transcript up to the piece's end, but a piece has any length and its own key space."""
    return _chained_key(_PIECE_KEY_VERSION, namespace, parent, token_ids)
