"""Framing, strict decoding, the checksum and size parsing, without a store."""

import socket

import msgspec
import pytest

from kmesh.errors import InvalidRequestError
from kmesh.store.framing import MAX_FRAME_BYTES, encode_frame, read_frame, take_frame
from kmesh.store.protocol import (
    Acquire,
    Acquired,
    HitInfo,
    ProtocolError,
    checksum,
    decode_answer,
    decode_request,
)
from kmesh.store.server import parse_size

KEY = bytes(range(32))


def _body(message: object) -> bytes:
    return msgspec.msgpack.encode(message)


def test_frames_round_trip_and_split_from_a_stream():
    request = Acquire([KEY], wait=1.5, family="f", tenant="t")
    answer = Acquired(hits=[HitInfo("seg", 10, 7, b"")], lead=2, lease=60.0)
    stream = bytearray(encode_frame(request) + encode_frame(answer))
    partial = bytearray(stream[:7])
    assert take_frame(partial) is None and len(partial) == 7  # incomplete: left in place
    assert decode_request(take_frame(stream)) == request
    assert decode_answer(take_frame(stream)) == answer
    assert stream == bytearray() and take_frame(stream) is None


@pytest.mark.parametrize("length", [0, MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
def test_a_length_prefix_out_of_range_is_a_bad_frame(length):
    with pytest.raises(ProtocolError) as error:
        take_frame(bytearray(length.to_bytes(4, "big") + b"x"))
    assert error.value.code == "bad_frame"


def test_read_frame_reports_a_closed_connection_mid_frame():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall((100).to_bytes(4, "big") + b"only part")
        theirs.close()
        with pytest.raises(ConnectionError):
            read_frame(ours)


@pytest.mark.parametrize(
    ("message", "code", "text"),
    [
        ({"v": 2, "op": "ping", "tenant": None}, "bad_version", "version 2 is not supported"),
        ({"v": 1, "op": "launch", "tenant": None}, "unknown_op", "unknown message type 'launch'"),
        ({"v": 1, "op": "ping"}, "bad_request", "missing required field `tenant`"),
        ({"v": 1, "op": "ping", "tenant": None, "x": 1}, "bad_request", "unknown field `x`"),
        ({"op": "ping", "tenant": None}, "bad_request", "missing required field `v`"),
        ([1, 2, 3], "bad_request", "not a request map"),
        (
            {"v": 1, "op": "acquire", "tenant": None, "keys": [b"short"]},
            "bad_request",
            "length >= 32",
        ),
        (
            {"v": 1, "op": "acquire", "tenant": None, "keys": [KEY] * 1025},
            "bad_request",
            "length <= 1024",
        ),
        (
            {"v": 1, "op": "reserve", "tenant": None, "key": KEY, "size": 0},
            "bad_request",
            ">= 1",
        ),
        (
            {"v": 1, "op": "acquire", "tenant": None, "keys": [], "wait": -1.0},
            "bad_request",
            ">= 0.0",
        ),
        ({"v": 1, "op": "ping", "tenant": ""}, "bad_request", "length >= 1"),
    ],
)
def test_bad_requests_are_named_precisely(message, code, text):
    with pytest.raises(ProtocolError, match=text) as error:
        decode_request(_body(message))
    assert error.value.code == code


def test_garbage_is_a_bad_request():
    with pytest.raises(ProtocolError) as error:
        decode_request(b"\xc1\xff\x00garbage")
    assert error.value.code == "bad_request"


def test_the_checksum_covers_key_meta_and_payload():
    payload = bytearray(b"state" * 1000)
    base = checksum(KEY, b"m", payload)
    assert checksum(KEY, b"m", memoryview(payload)) == base
    assert checksum(bytes(32), b"m", payload) != base
    assert checksum(KEY, b"n", payload) != base
    payload[4321] ^= 1
    assert checksum(KEY, b"m", payload) != base


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1 << 20),
        ("512K", 512 << 10),
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("2g", 2 << 30),
        ("1T", 1 << 40),
        ("64MiB", 64 << 20),
        ("64MB", 64 << 20),
    ],
)
def test_sizes_parse_in_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "abc", "1.5G", "-5", "0", "0M", "12Q", "1 G"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(InvalidRequestError, match="--capacity"):
        parse_size(text)
