"""Bad bytes on the socket: an error answer or a closed connection, and the store serves on."""

import contextlib
import random
import socket
import time

import msgspec
import pytest

from kmesh.store.framing import MAX_FRAME_BYTES, encode_frame, take_frame
from kmesh.store.protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Commit,
    Done,
    Error,
    Pin,
    Ping,
    Reserve,
    decode_answer,
)
from tests.store.helpers import (
    chain,
    connect_raw,
    digest,
    payload_for,
    read_digest,
    request_raw,
)

FUZZ_SECONDS = 3.0


def _works(store, seed: int) -> None:
    """A normal client can still publish and read."""
    keys = chain(1, seed)
    with store.client(timeout=5.0) as client:
        assert client.acquire(keys).lead == tuple(keys)
        client.publish(keys[0], payload_for(keys[0], 4096))
        [hit] = client.acquire(keys).hits
        assert read_digest(client, hit) == digest(payload_for(keys[0], 4096))


def _answers_until_closed(sock: socket.socket) -> list[object]:
    """Every answer frame the store sends until it closes the connection (after our SHUT_WR)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    answers = []
    while (body := take_frame(data)) is not None:
        answers.append(decode_answer(body))  # whatever it sends must be a valid answer
    assert not data, "the store sent a partial frame"
    return answers


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"v": PROTOCOL_VERSION, "op": "teleport", "tenant": None}, "unknown_op"),
        ({"v": PROTOCOL_VERSION + 1, "op": "ping", "tenant": None}, "bad_version"),
        ({"v": PROTOCOL_VERSION, "op": "acquire", "tenant": None, "keys": "k"}, "bad_request"),
        ("just a string", "bad_request"),
        (12345, "bad_request"),
    ],
)
def test_a_bad_message_gets_an_error_and_the_connection_goes_on(store, message, code):
    sock = connect_raw(store.socket)
    with sock:
        answer = decode_answer(request_raw(sock, message))
        assert isinstance(answer, Error) and answer.code == code and answer.message
        ping = {"v": PROTOCOL_VERSION, "op": "ping", "tenant": None}
        assert decode_answer(request_raw(sock, ping)) == Done()
    _works(store, seed=1)


@pytest.mark.parametrize("length", [0, MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
def test_a_bad_length_prefix_gets_an_error_and_a_closed_connection(store, length):
    sock = connect_raw(store.socket)
    with sock:
        sock.sendall(length.to_bytes(4, "big") + b"\x81\xa1v\x01")
        answers = _answers_until_closed(sock)
    assert [(type(a), getattr(a, "code", None)) for a in answers] == [(Error, "bad_frame")]
    _works(store, seed=2)


def test_a_truncated_frame_and_garbage_leave_the_store_serving(store):
    truncated = connect_raw(store.socket)
    truncated.sendall((100).to_bytes(4, "big") + b"\x85\xa1v\x01")  # then the client goes away
    truncated.close()
    garbage = connect_raw(store.socket)
    with garbage:
        garbage.sendall(random.Random(3).randbytes(5000))
        _answers_until_closed(garbage)
    silent = connect_raw(store.socket)  # an idle connection holds nobody up
    with silent:
        silent.sendall(b"\x00\x00")
        _works(store, seed=3)


def test_a_client_that_sends_without_reading_is_cut_off(store):
    sock = connect_raw(store.socket, timeout=10.0)
    pings = encode_frame(Ping(tenant=None)) * 1000
    with sock, pytest.raises(OSError):  # the store gives up on it after 2 MiB unanswered
        for _ in range(2000):
            sock.sendall(pings)
    _works(store, seed=4)


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "str", "bytes", "none", "float", "bool"]
    if depth < 3:
        kinds += ["list", "map"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), rng.randrange(-1000, 1000)])
    if kind == "str":
        return rng.choice(["", "acquire", "ping", "v", "op", "\x00", "é" * rng.randrange(5)])
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 1, 31, 32, 33]))
    if kind == "float":
        return rng.choice([0.0, -1.0, 1e308, float("nan"), float("inf"), 0.5])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "map":
        keys = [*_FIELDS, 0, 1, b"v", ""]
        return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(6))}
    return None


_FIELDS = ["v", "op", "tenant", "keys", "key", "size", "wait", "family", "checksum", "meta", "name"]
_OPS = ["acquire", "reserve", "commit", "abandon", "pin", "close_family", "drop", "stats", "ping"]


def _fuzz_frame(rng: random.Random) -> bytes:
    key = chain(1, rng.randrange(4))[0]
    valid = [
        Acquire([key], wait=rng.choice([0.0, 0.5]), tenant=None),
        Reserve(key, rng.randrange(1, 1 << 16), tenant="t"),
        Commit(key, checksum=7, meta=b"m", tenant=None),
        Pin("f", [key], tenant=None),
    ]
    choice = rng.randrange(5)
    if choice == 0:  # raw garbage
        return rng.randbytes(rng.randrange(1, 64))
    if choice == 1:  # a well-framed random value
        body = msgspec.msgpack.encode(_random_value(rng))
        return len(body).to_bytes(4, "big") + body
    if choice == 2:  # a request-shaped map with random values
        message = {name: _random_value(rng) for name in rng.sample(_FIELDS, rng.randrange(8))}
        message |= {"v": PROTOCOL_VERSION, "op": rng.choice(_OPS)}
        body = msgspec.msgpack.encode(message)
        return len(body).to_bytes(4, "big") + body
    frame = bytearray(encode_frame(rng.choice(valid)))
    if choice == 3:  # a valid request with flipped bytes (the prefix too, sometimes)
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    else:  # cut short
        del frame[rng.randrange(1, len(frame)) :]
    return bytes(frame)


def test_fuzzed_frames_never_stop_the_store(store):
    rng = random.Random(20240531)
    deadline = time.monotonic() + FUZZ_SECONDS
    sent = 0
    while time.monotonic() < deadline:
        sock = connect_raw(store.socket, timeout=5.0)
        with sock:
            try:
                for _ in range(rng.randrange(1, 4)):
                    sock.sendall(_fuzz_frame(rng))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the store closed it after a bad frame
            _answers_until_closed(sock)
        sent += 1
        if sent % 50 == 0:
            _works(store, seed=100 + sent)
    assert sent > 50 and store.process.poll() is None
    _works(store, seed=5)
    with store.client() as client:
        assert client.stats()["claims"] == 0  # every fuzzing connection's claims went with it
