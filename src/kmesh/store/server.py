"""The store process: a Store (state_machine.py) served on a Unix socket.

`StoreServer` serves a Store on a Unix socket from one thread with `selectors`: non-blocking
sockets, a read buffer per connection split into frames, a write buffer flushed when writable.
A connection's next request is only decoded once its previous answer has gone out and it is not
waiting, so a client that pipelines or stops reading only holds itself up. A bad frame (length
prefix out of range) gets an error answer and the connection is closed, since the stream cannot be
resynchronised; a well-framed bad message gets an error answer and the connection goes on. A
failure inside the store while handling one request closes that connection only. SIGTERM and
SIGINT stop `serve` cleanly: connections closed, segments unlinked, socket file removed.
"""

import contextlib
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kmesh.errors import InvalidRequestError, KMeshError
from kmesh.state.tenants import ApiKeys
from kmesh.store.framing import MAX_FRAME_BYTES, encode_frame, take_frame
from kmesh.store.orphans import reclaim_orphans
from kmesh.store.protocol import (
    AnyAnswer,
    Error,
    ProtocolError,
    decode_request,
)
from kmesh.store.remote.front import Probed, RemoteFront, Resolved, Written
from kmesh.store.remote.worker import RemoteConfig, RemoteWorker, start_worker
from kmesh.store.state_machine import DEFAULT_LEASE_S, Outbox, Store, StoreSession
from kmesh.store.tier import SHM_DIR, SharedMemoryTier

_RECV_BYTES = 1 << 16
_MAX_BUFFERED = 2 * (MAX_FRAME_BYTES + 4)  # unanswered input a connection may hold
_MAX_SELECT_S = 1.0
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    session: StoreSession
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    dead: bool = False


def _listen(path: Path) -> socket.socket:
    if path.is_symlink() or path.exists():
        if not path.is_socket():
            raise KMeshError(f"{path} exists and is not a socket; choose another --socket path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left behind by a store that died
        else:
            raise KMeshError(f"another store is already listening on {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)  # the segments are the owner's only too
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise KMeshError(f"cannot listen on {path}: {error}") from None
    listener.setblocking(False)
    return listener


class StoreServer:
    """A Store served on a Unix socket by one thread (see the module docstring)."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        capacity: int,
        lease: float = DEFAULT_LEASE_S,
        api_keys: ApiKeys | None = None,
        retention: str = "future_use",
        remote: RemoteConfig | None = None,
    ) -> None:
        self.path = Path(socket_path)
        self._resolved: deque[Resolved | Probed | Written] = (
            deque()
        )  # the remote worker's answers, not yet applied
        self._worker: RemoteWorker | None = None
        front = None
        if remote is not None:
            front = RemoteFront(grace=remote.lease)
            self._worker = start_worker(remote, self._arrived)
        self.store = Store(SharedMemoryTier(capacity, retention), lease, api_keys, front)
        self._listener = _listen(self.path)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._connections: dict[StoreSession, _Connection] = {}
        self._dead: list[_Connection] = []
        self._stopping = False

    def stop(self) -> None:
        """Make serve_forever return (safe from a signal handler or another thread)."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a wake-up is already pending, or we are closed
            self._wake_out.send(b"\0")

    def _arrived(self, resolved: Resolved | Probed | Written) -> None:
        """The remote worker's answer (on its thread): queue it and wake the loop."""
        self._resolved.append(resolved)
        self._wake()

    def serve_forever(self) -> None:
        while not self._stopping:
            for key, events in self._selector.select(self._select_timeout()):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_in:
                    self._drain_wake()
                else:
                    conn: _Connection = key.data
                    if events & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if events & selectors.EVENT_READ:
                        self._read(conn)
            self._reap()
            while self._resolved:
                self._deliver(self.store.remote_done(self._resolved.popleft(), time.monotonic()))
            self._deliver(self.store.expire(time.monotonic()))
            while any([self._pump(conn) for conn in list(self._connections.values())]):
                self._reap()
            self._reap()

    def close(self) -> None:
        """Close every connection, free every segment, remove the socket file."""
        for conn in self._connections.values():
            conn.sock.close()
        self._connections.clear()
        if self._worker is not None:
            self._worker.stop()
        self.store.tier.close()
        self._selector.close()
        self._listener.close()
        self._wake_in.close()
        self._wake_out.close()
        self.path.unlink(missing_ok=True)

    def _select_timeout(self) -> float:
        deadline = self.store.next_deadline()
        if deadline is None:
            return _MAX_SELECT_S
        return min(_MAX_SELECT_S, max(0.0, deadline - time.monotonic()))

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while self._wake_in.recv(64):
                pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of descriptors: the client sees a refused connect
                print(f"kmesh store: cannot accept a connection: {error}", file=sys.stderr)
                return
            sock.setblocking(False)
            conn = _Connection(sock, self.store.open())
            self._connections[conn.session] = conn
            self._selector.register(sock, conn.events, conn)

    def _read(self, conn: _Connection) -> None:
        if conn.dead:
            return
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._kill(conn)
        else:
            conn.inbuf += data
            if len(conn.inbuf) > _MAX_BUFFERED:
                self._fail(conn, "bad_frame", f"over {_MAX_BUFFERED} bytes sent unanswered")

    def _pump(self, conn: _Connection) -> bool:
        """Handle the connection's next buffered request, if it may have one now."""
        if conn.dead or conn.outbuf or self.store.busy(conn.session):
            return False
        try:
            body = take_frame(conn.inbuf)
        except ProtocolError as error:
            self._fail(conn, error.code, str(error))
            return True
        if body is None:
            return False
        try:
            request = decode_request(body)
        except ProtocolError as error:
            self._send(conn, Error(code=error.code, message=str(error)))
            return True
        try:
            out = self.store.handle(conn.session, request, time.monotonic())
        except Exception:
            print(f"kmesh store: internal error:\n{traceback.format_exc()}", file=sys.stderr)
            self._fail(conn, "internal", "the store failed on this request; see its log")
            return True
        self._deliver(out)
        return True

    def _deliver(self, out: Outbox) -> None:
        if self._worker is not None and self.store.remote is not None:
            self._worker.submit(self.store.remote.take_commands())
        for session, answer in out:
            conn = self._connections.get(session)
            if conn is not None and not conn.dead:
                self._send(conn, answer)

    def _send(self, conn: _Connection, answer: AnyAnswer) -> None:
        conn.outbuf += encode_frame(answer)
        self._flush(conn)

    def _fail(self, conn: _Connection, code: str, message: str) -> None:
        """Answer an error as far as the socket takes it now, then close the connection."""
        conn.outbuf += encode_frame(Error(code=code, message=message))
        with contextlib.suppress(OSError):
            conn.sock.send(conn.outbuf)
        self._kill(conn)

    def _flush(self, conn: _Connection) -> None:
        if conn.dead:
            return
        if conn.outbuf:
            try:
                del conn.outbuf[: conn.sock.send(conn.outbuf)]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._kill(conn)
                return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:
            conn.events = events
            self._selector.modify(conn.sock, events, conn)

    def _kill(self, conn: _Connection) -> None:
        if not conn.dead:
            conn.dead = True
            self._dead.append(conn)

    def _reap(self) -> None:
        """Close dead connections; their claims go to waiters."""
        while self._dead:
            conn = self._dead.pop()
            self._selector.unregister(conn.sock)
            conn.sock.close()
            del self._connections[conn.session]
            self._deliver(self.store.close(conn.session, time.monotonic()))


def parse_size(text: str, flag: str = "--capacity", least: int = 1) -> int:
    """Bytes from a size like 1048576, 512K, 512M, 2G or 1T (binary units; a trailing B or iB
    is allowed), at least `least`; `flag` names the option in errors."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit():
        raise InvalidRequestError(
            f"{flag} takes a size in bytes like 1048576, 512M or 2G; got {text!r}"
        )
    size = int(number) * _SIZE_UNITS[unit]
    if size < least:
        raise InvalidRequestError(f"{flag} must be at least {least} bytes, got {text!r}")
    return size


def serve(
    socket_path: str | os.PathLike[str],
    capacity: int,
    lease: float = DEFAULT_LEASE_S,
    on_ready: Callable[[], None] | None = None,
    api_keys: ApiKeys | None = None,
    retention: str = "future_use",
    remote: RemoteConfig | None = None,
) -> None:
    """Run a store on `socket_path` until SIGTERM or SIGINT; `on_ready` is called once it
    accepts connections. `api_keys`: connections must say hello with one (module docstring);
    `remote`: the remote tier it stands in front of."""
    if not lease > 0:  # NaN too
        raise InvalidRequestError(f"--lease must be a positive number of seconds, got {lease}")
    server = StoreServer(socket_path, capacity, lease, api_keys, retention, remote)
    orphans, freed = reclaim_orphans(SHM_DIR)
    if orphans:
        print(
            f"kmesh store: freed {orphans} shared memory segments ({freed} bytes) left in "
            f"{SHM_DIR} by stores that died",
            file=sys.stderr,
        )
    if SHM_DIR.is_dir():
        stat = os.statvfs(SHM_DIR)
        free = stat.f_bavail * stat.f_frsize
        if capacity > free:
            print(
                f"kmesh store: warning: capacity {capacity} bytes exceeds the {free} bytes free "
                f"in {SHM_DIR}; publishes will be refused once it is full",
                file=sys.stderr,
            )
    previous = {
        sig: signal.signal(sig, lambda _sig, _frame: server.stop())
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        if on_ready is not None:
            on_ready()
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
