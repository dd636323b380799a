"""The thread that carries out the front's commands (front.py) on the remote tier.

The store's own thread never waits on the network: it hands commands to `submit` and gets
`Resolved` answers back through `deliver` (called on this thread; it must only queue and wake).
- Resolve (one chain, in order): entries found remotely are fetched (and checked); for the
  missing ones, from the first on, this machine takes the remote claims (generation 0, or the
  next after a released or dead claim) in one batch, up to a key another machine holds alive:
  that key and the rest wait with it, since a chain is computed front to back. After taking
  claims it looks for their entries once more (a machine that published just before may have
  ended the claim the new one followed). A holder found dead on one key is dead on all; a
  record that cannot be read (the memory it was in is gone) runs out like one nobody beats.
  Waiting keys are watched every POLL_S seconds until
  published (fetched), their holder dies (leases.py: the claim is taken over) or `watch`
  seconds pass (failed: computed here).
- WriteThrough: the local segment's bytes are put remotely, then the claim records are removed.
- Release: the claim record is marked released.
- Probe: which keys exist remotely (none, if the tier does not answer).
- Claims held here are beaten every lease / 4 seconds.
After a call the remote tier does not answer, it is left alone for `backoff` seconds: every
Resolve meanwhile fails at once (keys are computed here), writes are dropped.
"""

import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import shared_memory

from kmesh.errors import InvalidRequestError
from kmesh.store.remote.front import (
    Command,
    Probe,
    Probed,
    Release,
    Resolve,
    Resolved,
    WriteThrough,
    Written,
)
from kmesh.store.remote.leases import ForeignLeases
from kmesh.store.remote.mooncake_tier import MooncakeTier, RemoteEntry
from kmesh.store.tier import EntryId

log = logging.getLogger(__name__)

MIN_LEND = 16 << 20  # Mooncake Store refuses smaller segments
POLL_S = 0.02
BACKOFF_S = 1.0


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """Where the remote tier is and how this store joins it (`kmesh store serve --remote`)."""

    master: str  # HOST:PORT of mooncake_master's RPC
    metadata: str  # its HTTP metadata server's URL
    hostname: str  # HOST:PORT other machines reach this one's lent memory at
    lend: int  # bytes of this machine's memory lent to the remote tier
    lease: float = 5.0  # a remote claim not beaten for this long is taken over
    watch: float = 60.0  # how long a key another machine computes is waited for


def remote_config(master: str, metadata: str | None, lend: int, lease: float) -> RemoteConfig:
    """A RemoteConfig from `--remote HOST:PORT` and its flags; this machine's address is the
    one its traffic to the master leaves from."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidRequestError(f"--remote takes the master's HOST:PORT, got {master!r}")
    if not lease > 0:
        raise InvalidRequestError(f"--remote-lease must be positive seconds, got {lease}")
    if 0 < lend < MIN_LEND:
        raise InvalidRequestError(
            f"--remote-lend must be 0 (lend nothing) or at least {MIN_LEND >> 20}M, Mooncake's "
            f"smallest segment; got {lend} bytes"
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # no packet is sent: only a route is chosen
            own = probe.getsockname()[0]
    except OSError as error:
        raise InvalidRequestError(f"--remote {master}: no route to it ({error})") from None
    url = metadata or f"http://{host}:8080/metadata"
    return RemoteConfig(master, url, own, lend, lease)


def start_worker(
    config: RemoteConfig, deliver: Callable[[Resolved | Probed | Written], None]
) -> "RemoteWorker":
    """Join the remote tier (RemoteUnavailable if it cannot) and start a worker on it."""
    tier = MooncakeTier(config.master, config.metadata, config.hostname, config.lend)
    worker = RemoteWorker(tier, config.lease, config.watch, deliver)
    worker.start()
    return worker


class RemoteWorker:
    """See the module docstring; `start`, `submit`, `stop`."""

    def __init__(
        self,
        tier: MooncakeTier,
        lease: float,
        watch: float,
        deliver: Callable[[Resolved | Probed | Written], None],
    ) -> None:
        self.tier = tier
        self.lease = lease
        self.watch = watch
        self.deliver = deliver
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._inbox: queue.Queue[Command | None] = queue.Queue()
        self._leases = ForeignLeases(lease)
        self._watched: list[_Watched] = []  # chains other machines compute
        self._next_watch = 0.0
        self._mine: dict[EntryId, list[int]] = {}  # claims held here: [generation, beat]
        self._down_until = 0.0
        self._next_beat = 0.0
        self._thread = threading.Thread(target=self._run, name="kmesh-remote", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, commands: list[Command]) -> None:
        for command in commands:
            self._inbox.put(command)

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(30.0)
        self.tier.close()

    def _run(self) -> None:
        while True:
            try:
                command = self._inbox.get(timeout=POLL_S)
            except queue.Empty:
                command = _IDLE
            if command is None:
                return
            try:
                self._step(command)
            except Exception:  # a bug here must not stop the store: log it, compute locally
                log.exception("kmesh store: the remote worker failed on %s", command)
                if isinstance(command, Resolve) and command.idents:
                    self.deliver(Resolved(failed=command.idents))
                elif isinstance(command, WriteThrough):
                    self.deliver(Written(command.ident, False))

    def _step(self, command: Command) -> None:
        now = time.monotonic()
        match command:
            case Resolve(idents=idents) if idents:
                self._send(self._resolve(idents, now))
            case WriteThrough():
                self._write(command)
            case Probe(probe=probe, idents=idents):
                found = None if self._down(now) else self.tier.present(idents)
                if found is None:
                    self._fail(now)
                self.deliver(Probed(probe, tuple(found or [False] * len(idents))))
            case Release(ident=ident, claim=claim):
                self._mine.pop(ident, None)
                if not self._down(now):
                    self.tier.release_claim(ident, claim, self.holder)
        if self._watched and now >= self._next_watch and not self._down(now):
            self._next_watch = now + POLL_S
            self._send(self._watch(now))
        if self._mine and now >= self._next_beat and not self._down(now):
            self._next_beat = now + self.lease / 4
            for mine in self._mine.values():
                mine[1] += 1
            self.tier.beat([(i, g, b) for i, (g, b) in self._mine.items()], self.holder)

    def _send(self, resolved: Resolved) -> None:
        if resolved.fetched or resolved.claimed or resolved.busy or resolved.failed:
            self.deliver(resolved)

    def _down(self, now: float) -> bool:
        return now < self._down_until

    def _fail(self, now: float) -> None:
        if not self._down(now):  # once per outage second, not once per key
            log.warning("kmesh store: the remote tier did not answer (%s)", self.tier.error)
            self._down_until = now + BACKOFF_S

    def _resolve(self, chain: tuple[EntryId, ...], now: float) -> Resolved:
        answer = _Answer()
        busy = None if self._down(now) else self._settle(chain, now, answer)
        if busy is None:
            self._fail(now)
            return Resolved(failed=chain)
        if busy:
            answer.busy += busy
            self._watched.append(_Watched(busy, now + self.watch))
        return answer.resolved()

    def _watch(self, now: float) -> Resolved:
        """Look again at the keys other machines hold."""
        answer = _Answer()
        watched, self._watched = self._watched, []
        for index, item in enumerate(watched):
            busy = self._settle(item.chain, now, answer)
            if busy is None:
                self._fail(now)
                self._watched += watched[index:]
                break
            if busy and now >= item.until:
                answer.failed += busy
            elif busy:
                self._watched.append(_Watched(busy, item.until))
                continue
            for ident in item.chain:
                self._leases.forget(ident)
        return answer.resolved()

    def _settle(
        self, chain: tuple[EntryId, ...], now: float, answer: "_Answer"
    ) -> tuple[EntryId, ...] | None:
        """Fetch the chain's published keys; take the claims of the missing ones from the first
        on, up to one another machine holds alive (a chain is computed front to back, so the
        rest waits with it). Answers the keys still held elsewhere (None: no answer)."""
        present = self.tier.present(chain)
        if present is None:
            return None
        there = [ident for ident, found in zip(chain, present, strict=True) if found]
        entries = dict(zip(there, self.tier.get(there), strict=True))
        answer.fetched += [(i, e) for i, e in entries.items() if e is not None]
        absent = [ident for ident in chain if entries.get(ident) is None]
        records = self.tier.latest_claims(absent) if absent else []
        if records is None:
            return None
        free, dead = [], set()
        for ident, record in zip(absent, records, strict=True):
            if record is None:
                free.append((ident, 0))
            elif record.released or record.holder == self.holder:
                free.append((ident, record.generation + 1))
            elif record.holder in dead or self._leases.expired(
                ident, record.generation, record.beat, now
            ):
                dead.add(record.holder)
                free.append((ident, record.generation + 1))
            else:
                break
        won = [
            c for c, ok in zip(free, self.tier.take_claims(free, self.holder), strict=True) if ok
        ]
        # A machine that published just now may have ended the claim a new one followed.
        late = self.tier.present([ident for ident, _ in won]) if won else []
        for (ident, generation), published in zip(won, late or [False] * len(won), strict=True):
            if published:
                self.tier.release_claim(ident, generation, self.holder)
                [entry] = self.tier.get([ident])
                if entry is None:
                    answer.failed.append(ident)
                else:
                    answer.fetched.append((ident, entry))
            else:
                self._leases.forget(ident)
                self._mine[ident] = [generation, 0]
                answer.claimed.append((ident, generation))
        settled = {ident for ident, _ in won}
        return tuple(ident for ident in absent if ident not in settled)

    def _write(self, command: WriteThrough) -> None:
        stored = self._put(command)
        self.deliver(Written(command.ident, stored))

    def _put(self, command: WriteThrough) -> bool:
        mine = self._mine.pop(command.ident, None)
        if self._down(time.monotonic()):
            return False
        try:
            segment = shared_memory.SharedMemory(command.segment)
        except FileNotFoundError:  # evicted locally before it could be written: nothing to do
            if mine is not None:
                self.tier.release_claim(command.ident, mine[0], self.holder)
            return False
        try:
            assert segment.buf is not None
            payload = segment.buf[: command.size]
            stored = self.tier.put(
                command.ident, payload, command.checksum, command.meta, command.pin
            )
            del payload
        finally:
            segment.close()
        if mine is not None:
            if stored:
                self.tier.forget_claims(command.ident, mine[0])
            else:  # refused (the remote tier is full): another machine may compute it
                self.tier.release_claim(command.ident, mine[0], self.holder)
        return stored


_IDLE = Resolve(())  # no command this poll: only watch and beat


@dataclass(frozen=True, slots=True)
class _Watched:
    chain: tuple[EntryId, ...]  # the keys still held elsewhere, in chain order
    until: float  # when they are given up (failed: computed here)


@dataclass(slots=True)
class _Answer:
    fetched: list[tuple[EntryId, RemoteEntry]] = field(default_factory=list)
    claimed: list[tuple[EntryId, int]] = field(default_factory=list)
    busy: list[EntryId] = field(default_factory=list)
    failed: list[EntryId] = field(default_factory=list)

    def resolved(self) -> Resolved:
        return Resolved(
            tuple(self.fetched), tuple(self.claimed), tuple(self.busy), tuple(self.failed)
        )
