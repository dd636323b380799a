"""The store's framing: a 4-byte big-endian length, then that many bytes of one message
(protocol.py), at most MAX_FRAME_BYTES. A bad length prefix raises ProtocolError `bad_frame`.
"""

import socket
from typing import Final

import msgspec

from kmesh.store.protocol import Answer, ProtocolError, Request

MAX_FRAME_BYTES: Final = 1 << 20
_LENGTH_BYTES: Final = 4

_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Request | Answer) -> bytes:
    """The message as one frame: length prefix, then MessagePack."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame")
    return len(body).to_bytes(_LENGTH_BYTES, "big") + body


def _frame_length(prefix: bytes | bytearray) -> int:
    length = int.from_bytes(prefix[:_LENGTH_BYTES], "big")
    if not 0 < length <= MAX_FRAME_BYTES:
        raise ProtocolError(
            "bad_frame", f"frame length {length} is not within 1..{MAX_FRAME_BYTES} bytes"
        )
    return length


def take_frame(buffer: bytearray) -> bytes | None:
    """Remove and return the first complete frame's body from `buffer`, or None if the buffer
    holds no complete frame yet; a bad length prefix raises ProtocolError."""
    if len(buffer) < _LENGTH_BYTES:
        return None
    end = _LENGTH_BYTES + _frame_length(buffer)
    if len(buffer) < end:
        return None
    body = bytes(buffer[_LENGTH_BYTES:end])
    del buffer[:end]
    return body


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("the store closed the connection")
        chunks += chunk
    return bytes(chunks)


def read_frame(sock: socket.socket) -> bytes:
    """One frame's body from a blocking socket (its timeout applies to every recv); EOF raises
    ConnectionError, a bad length prefix ProtocolError."""
    return _recv_exactly(sock, _frame_length(_recv_exactly(sock, _LENGTH_BYTES)))
