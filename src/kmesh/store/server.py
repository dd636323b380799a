"""The store process: keyed state in shared memory, one computation per missing key.

`Store` is the whole state machine, with no sockets: sessions (one per connection) send requests
and get answers, some of them later (a waiting `acquire`) or to other sessions (a `commit` wakes
the waiters of its key). A key of a tenant is, for the store:

    absent --acquire--> claimed (one leader) --reserve, commit--> published --evict/drop--> absent
    claimed --abandon, refused reserve, leader gone, lease run out--> absent (+ a waiter promoted)

`acquire` walks a chain of keys: the published prefix is answered as hits; if the first missing
key is claimed by another session the request waits for it (up to its `wait`); otherwise the
session claims it and every following key that is neither published nor claimed. Waiters of a
key are kept in arrival order. When the key is published they all see it as a hit (and go on
down their chain); when its claim goes away they are re-evaluated in order, so the first becomes
the new leader and the rest keep waiting, on it. Nothing is computed twice while a leader lives,
and no waiter is left behind when a leader dies. A leader's lease is renewed by every request of
its session; a session whose lease runs out loses its claims as if it had abandoned them.

Entries are filed under (key, tenant): a tenant's lookup never sees another's entry, claim or
waiters, so its answers are those of a plain miss. With API keys (kmesh/state/tenants.py), a
connection's first request is a `hello` with a key (anything else, or an unknown key, gets an
`unauthorized` error), and the key's tenant scopes every later request: the `tenant` a client
names only subdivides its key's (tenant_salt), so no client can name another key's entries.
Pins belong to a (session, family): `close_family` or the session's end takes them back, so a
dead client cannot pin state forever.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kmesh.errors import InvalidRequestError, KMeshError
from kmesh.state.tenants import ApiKeys, tenant_salt
from kmesh.store.protocol import (
    MAX_FRAME_BYTES,
    Abandon,
    Acquire,
    Acquired,
    AnyAnswer,
    AnyRequest,
    CloseFamily,
    Commit,
    Done,
    Drop,
    Error,
    Hello,
    HitInfo,
    Pin,
    Ping,
    ProtocolError,
    Refused,
    Request,
    Reserve,
    Reserved,
    Stats,
    StatsInfo,
    decode_request,
    encode_frame,
    take_frame,
)
from kmesh.store.tier import CapacityError, EntryId, SharedMemoryTier, StoredEntry, Tier

DEFAULT_LEASE_S = 60.0
_RECV_BYTES = 1 << 16
_MAX_BUFFERED = 2 * (MAX_FRAME_BYTES + 4)  # unanswered input a connection may hold
_MAX_SELECT_S = 1.0
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True, slots=True)
class _Wait:
    request: Acquire
    deadline: float
    blocked_on: EntryId


@dataclass(eq=False, slots=True)
class Session:
    """What the store knows of one connection."""

    claims: dict[EntryId, None] = field(default_factory=dict)  # a set, in claim order
    lease_deadline: float = 0.0
    families: dict[str, dict[EntryId, int]] = field(default_factory=dict)  # -> entry serial
    waiting: _Wait | None = None
    tenant: str | None = None  # its API key's tenant, once it said hello (with API keys)


@dataclass(eq=False, slots=True)
class _Claim:
    leader: Session
    reservation: str | None = None  # segment being written, once the leader reserved


Outbox = list[tuple[Session, AnyAnswer]]


class Store:
    """Claims, waiters, leases and pins over a tier; see the module docstring."""

    def __init__(
        self, tier: Tier, lease: float = DEFAULT_LEASE_S, api_keys: ApiKeys | None = None
    ) -> None:
        if not lease > 0:  # NaN too
            raise ValueError(f"lease must be positive, got {lease}")
        self.tier = tier
        self.lease = lease
        self.api_keys = api_keys
        self.sessions: set[Session] = set()
        self._claims: dict[EntryId, _Claim] = {}
        self._waiters: dict[EntryId, list[Session]] = {}
        self._counts = dict.fromkeys(
            ("hits", "misses", "published", "refused", "promoted", "expired"), 0
        )

    def open(self) -> Session:
        session = Session()
        self.sessions.add(session)
        return session

    def handle(self, session: Session, request: AnyRequest, now: float) -> Outbox:
        """Answers to send: this session's (unless it now waits) and any it caused others."""
        if self.api_keys is not None:
            scoped = self._authorized(session, request)
            if not isinstance(scoped, Request):
                return [(session, scoped)]
            request = scoped
        out: Outbox = []
        session.lease_deadline = now + self.lease
        match request:
            case Acquire():
                self._acquire(session, request, now + request.wait, now, out)
            case Reserve(key=key, tenant=tenant, size=size):
                out.append((session, self._reserve(session, (key, tenant), size, now, out)))
            case Commit():
                out.append((session, self._commit(session, request, now, out)))
            case Abandon(keys=keys, tenant=tenant):
                idents = dict.fromkeys((k, tenant) for k in keys)
                mine = [ident for ident in idents if self._leader(ident) is session]
                self._release(mine, now, out)
                out.append((session, Done(count=len(mine))))
            case Pin(family=family, keys=keys, tenant=tenant):
                count = sum(self._pin(session, family, (k, tenant)) is not None for k in keys)
                out.append((session, Done(count=count)))
            case CloseFamily(family=family):
                out.append((session, Done(count=self._close_family(session, family))))
            case Drop(key=key, tenant=tenant, name=name):
                out.append((session, Done(count=int(self.tier.drop((key, tenant), name)))))
            case Stats():
                out.append((session, self._stats()))
            case Ping() | Hello():
                out.append((session, Done()))
        return out

    def _authorized(self, session: Session, request: AnyRequest) -> AnyRequest | AnyAnswer:
        """The request in its session's tenant, or the answer refusing it."""
        assert self.api_keys is not None
        if isinstance(request, Hello):
            session.tenant = self.api_keys.tenant_of_key(request.key)
            if session.tenant is None:
                return Error(code="unauthorized", message="the API key is not valid")
        elif session.tenant is None:
            return Error(code="unauthorized", message="send a hello with an API key first")
        return msgspec.structs.replace(request, tenant=tenant_salt(session.tenant, request.tenant))

    def close(self, session: Session, now: float) -> Outbox:
        """The session's connection is gone: stop its wait, release its pins and claims."""
        out: Outbox = []
        if session.waiting is not None:
            self._unwait(session)
        for family in list(session.families):
            self._close_family(session, family)
        self._release(list(session.claims), now, out)
        self.sessions.discard(session)
        return out

    def expire(self, now: float) -> Outbox:
        """Release the claims of sessions whose lease ran out (promoting waiters), then answer
        waits that ran out."""
        out: Outbox = []
        for session in list(self.sessions):
            if session.claims and session.lease_deadline <= now:
                self._counts["expired"] += len(session.claims)
                self._release(list(session.claims), now, out)
        for session in list(self.sessions):
            wait = session.waiting
            if wait is not None and wait.deadline <= now:
                self._unwait(session)
                self._acquire(session, wait.request, now, now, out)
        return out

    def next_deadline(self) -> float | None:
        deadlines = [s.lease_deadline for s in self.sessions if s.claims]
        deadlines += [s.waiting.deadline for s in self.sessions if s.waiting is not None]
        return min(deadlines, default=None)

    def _leader(self, ident: EntryId) -> Session | None:
        claim = self._claims.get(ident)
        return None if claim is None else claim.leader

    def _acquire(
        self, session: Session, request: Acquire, deadline: float, now: float, out: Outbox
    ) -> int:
        """Evaluate `request` for `session`: answer it, or park it as a waiter until `deadline`.
        Returns how many keys the session now leads."""
        tenant = request.tenant
        hits: list[StoredEntry] = []
        for key in request.keys:
            entry = self.tier.lookup((key, tenant))
            if entry is None:
                break
            hits.append(entry)
        rest = request.keys[len(hits) :]
        blocked = None
        lead = 0
        if rest:
            first = (rest[0], tenant)
            leader = self._leader(first)
            if leader is not None and leader is not session:
                blocked = first
        if blocked is not None and deadline > now:
            session.waiting = _Wait(request, deadline, blocked)
            self._waiters.setdefault(blocked, []).append(session)
            return 0
        if blocked is None:
            for key in rest:
                ident = (key, tenant)
                leader = self._leader(ident)
                if leader is None and self.tier.lookup(ident) is None:
                    self._claims[ident] = _Claim(session)
                    session.claims[ident] = None
                elif leader is not session:
                    break
                lead += 1
        if lead:
            session.lease_deadline = now + self.lease
        if request.family is not None:
            for key in request.keys[: len(hits)]:
                self._pin(session, request.family, (key, tenant))
        self._counts["hits"] += len(hits)
        self._counts["misses"] += lead
        infos = [HitInfo(e.name, e.size, e.checksum, e.meta) for e in hits]
        answer = Acquired(hits=infos, lead=lead, wait=blocked is not None, lease=self.lease)
        out.append((session, answer))
        return lead

    def _unwait(self, session: Session) -> None:
        assert session.waiting is not None
        ident = session.waiting.blocked_on
        waiters = self._waiters[ident]
        waiters.remove(session)
        if not waiters:
            del self._waiters[ident]
        session.waiting = None

    def _wake(self, ident: EntryId, now: float, out: Outbox) -> int:
        """Re-evaluate the waiters of `ident` in arrival order; returns how many now lead."""
        promoted = 0
        for waiter in self._waiters.pop(ident, []):
            wait = waiter.waiting
            assert wait is not None
            waiter.waiting = None
            promoted += self._acquire(waiter, wait.request, wait.deadline, now, out) > 0
        return promoted

    def _release(self, idents: list[EntryId], now: float, out: Outbox) -> None:
        """Claims that end without a publish: the keys are absent again. All go before any
        waiter is re-evaluated, so a promoted waiter can lead the whole chain its leader had."""
        for ident in idents:
            claim = self._claims.pop(ident)
            del claim.leader.claims[ident]
            if claim.reservation is not None:
                self.tier.cancel(claim.reservation)
        for ident in idents:
            self._counts["promoted"] += self._wake(ident, now, out)

    def _reserve(
        self, session: Session, ident: EntryId, size: int, now: float, out: Outbox
    ) -> AnyAnswer:
        claim = self._claims.get(ident)
        if claim is None or claim.leader is not session:
            return _not_leader()
        if claim.reservation is not None:
            self.tier.cancel(claim.reservation)
            claim.reservation = None
        try:
            claim.reservation = self.tier.reserve(size)
        except CapacityError as error:
            self._counts["refused"] += 1
            self._release([ident], now, out)
            return Refused(code=error.code, reason=f"{error}; the key's claim was released")
        return Reserved(name=claim.reservation)

    def _commit(self, session: Session, request: Commit, now: float, out: Outbox) -> AnyAnswer:
        ident = (request.key, request.tenant)
        claim = self._claims.get(ident)
        if claim is None or claim.leader is not session:
            return _not_leader()
        if claim.reservation is None:
            return Refused(code="not_reserved", reason="commit before reserve: nothing was written")
        self.tier.commit(ident, claim.reservation, request.checksum, request.meta)
        del self._claims[ident]
        del session.claims[ident]
        self._counts["published"] += 1
        if request.family is not None:
            self._pin(session, request.family, ident)
        self._wake(ident, now, out)
        return Done(count=1)

    def _pin(self, session: Session, family: str, ident: EntryId) -> StoredEntry | None:
        """Pin the entry of `ident` for the session's `family` (once per entry and family)."""
        entry = self.tier.lookup(ident)
        if entry is None:
            return None
        pins = session.families.setdefault(family, {})
        if pins.get(ident) != entry.serial:
            self.tier.pin(ident)
            pins[ident] = entry.serial
        return entry

    def _close_family(self, session: Session, family: str) -> int:
        pins = session.families.pop(family, {})
        for ident, serial in pins.items():
            self.tier.unpin(ident, serial)
        return len(pins)

    def _stats(self) -> StatsInfo:
        tier = self.tier.stats()
        return StatsInfo(
            capacity=tier.capacity,
            used=tier.used,
            entries=tier.entries,
            pinned=tier.pinned,
            reserved=tier.reserved,
            claims=len(self._claims),
            waiters=sum(len(w) for w in self._waiters.values()),
            connections=len(self.sessions),
            evicted=tier.evicted,
            dropped=tier.dropped,
            **self._counts,
        )


def _not_leader() -> Refused:
    return Refused(
        code="not_leader",
        reason="this connection does not hold the key's claim (it was published, abandoned, "
        "refused, or its lease ran out)",
    )


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    session: Session
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
    ) -> None:
        self.path = Path(socket_path)
        self.store = Store(SharedMemoryTier(capacity), lease, api_keys)
        self._listener = _listen(self.path)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._connections: dict[Session, _Connection] = {}
        self._dead: list[_Connection] = []
        self._stopping = False

    def stop(self) -> None:
        """Make serve_forever return (safe from a signal handler or another thread)."""
        self._stopping = True
        with contextlib.suppress(OSError):  # a wake-up is already pending, or we are closed
            self._wake_out.send(b"\0")

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
            self._deliver(self.store.expire(time.monotonic()))
            while any([self._pump(conn) for conn in list(self._connections.values())]):
                self._reap()
            self._reap()

    def close(self) -> None:
        """Close every connection, free every segment, remove the socket file."""
        for conn in self._connections.values():
            conn.sock.close()
        self._connections.clear()
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
        if conn.dead or conn.outbuf or conn.session.waiting is not None:
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


def parse_size(text: str, flag: str = "--capacity") -> int:
    """Bytes from a size like 1048576, 512K, 512M, 2G or 1T (binary units; a trailing B or iB
    is allowed); `flag` names the option in errors."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit():
        raise InvalidRequestError(
            f"{flag} takes a size in bytes like 1048576, 512M or 2G; got {text!r}"
        )
    size = int(number) * _SIZE_UNITS[unit]
    if size < 1:
        raise InvalidRequestError(f"{flag} must be at least one byte, got {text!r}")
    return size


def serve(
    socket_path: str | os.PathLike[str],
    capacity: int,
    lease: float = DEFAULT_LEASE_S,
    on_ready: Callable[[], None] | None = None,
    api_keys: ApiKeys | None = None,
) -> None:
    """Run a store on `socket_path` until SIGTERM or SIGINT; `on_ready` is called once it
    accepts connections. `api_keys`: connections must say hello with one (module docstring)."""
    if not lease > 0:  # NaN too
        raise InvalidRequestError(f"--lease must be a positive number of seconds, got {lease}")
    server = StoreServer(socket_path, capacity, lease, api_keys)
    shm = Path("/dev/shm")
    if shm.is_dir():
        stat = os.statvfs(shm)
        free = stat.f_bavail * stat.f_frsize
        if capacity > free:
            print(
                f"kmesh store: warning: capacity {capacity} bytes exceeds the {free} bytes free "
                f"in {shm}; publishes will be refused once it is full",
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
