"""Keys, payloads, raw protocol access and the client processes the store tests start."""

import hashlib
import multiprocessing
import os
import random
import socket
import time
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from kmesh.state.keys import BlockHash, KeyNamespace, block_key
from kmesh.store import StoreClient
from kmesh.store.framing import read_frame
from kmesh.store.hits import Hit
from kmesh.store.tier import SHM_DIR

PAYLOAD_BYTES = 64 * 1024
SPAWN = multiprocessing.get_context("spawn")


def chain(blocks: int, seed: int, tenant: str | None = None) -> list[bytes]:
    """The block keys of a prompt of `blocks` full 16-token blocks."""
    namespace = KeyNamespace(model="f" * 64, tenant_salt=tenant)
    rng = random.Random(seed)
    keys: list[bytes] = []
    parent: BlockHash | None = None
    for _ in range(blocks):
        parent = block_key(namespace, parent, [rng.randrange(3, 32000) for _ in range(16)])
        keys.append(parent)
    return keys


def payload_for(key: bytes, size: int = PAYLOAD_BYTES, salt: bytes = b"") -> bytes:
    """The 'computed state' of a key: random bytes fixed by the key."""
    return random.Random(key + salt).randbytes(size)


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def read_digest(client: StoreClient, hit: Hit) -> str:
    with client.read(hit) as entry:
        return digest(entry.data)


def request_raw(sock: socket.socket, message: Any) -> bytes:
    """Send a message (any msgpack-able value) in one frame, unchecked; return the answer
    frame's raw body."""
    body = msgspec.msgpack.encode(message)
    sock.sendall(len(body).to_bytes(4, "big") + body)
    return read_frame(sock)


def connect_raw(path: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def corrupt_segment(name: str, offset: int) -> None:
    """Flip one byte of a store segment in place, as a stray write would."""
    with (SHM_DIR / name).open("r+b") as segment:
        segment.seek(offset)
        byte = segment.read(1)[0]
        segment.seek(offset)
        segment.write(bytes([byte ^ 0xFF]))


def fetch_or_compute(
    socket_path: str,
    keys: list[bytes],
    compute_s: float,
    start: Any,
    results: Any,
) -> None:
    """A client process: acquire the chain, wait if another leads, compute (sleep) and publish
    what it leads, then read every key. Reports (pid, keys led, digests) or (pid, -1, error)."""
    try:
        with StoreClient(socket_path, timeout=10.0) as client:
            if start is not None:
                start.wait(60.0)
            got = client.acquire(keys)
            if got.waiting_on is not None:
                got = client.wait(keys, timeout=60.0)
            if got.lead:
                time.sleep(compute_s)
                for key in got.lead:
                    client.publish(key, payload_for(key))
            final = client.acquire(keys)
            digests = [read_digest(client, hit) for hit in final.hits]
        results.put((os.getpid(), len(got.lead), digests))
    except BaseException as error:
        results.put((os.getpid(), -1, repr(error)))


def stalled_leader(socket_path: str, keys: list[bytes], leading: Any) -> None:
    """A client process that leads the chain, then hangs in its 'computation'."""
    client = StoreClient(socket_path, timeout=10.0)
    got = client.acquire(keys)
    if list(got.lead) == keys:
        leading.set()
    time.sleep(120)


def collect(results: Any, processes: list[BaseProcess], timeout: float) -> list[tuple]:
    """One result per process within `timeout` seconds in all; every process is gone after."""
    deadline = time.monotonic() + timeout
    try:
        return [results.get(timeout=max(0.1, deadline - time.monotonic())) for _ in processes]
    finally:
        for process in processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
