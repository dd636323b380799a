"""The local store in front of the remote tier: what it asks the remote worker, and what it does
with the answers. No I/O and no clock: the Store (state_machine.py) calls it with `now`.

A key absent from this machine's tier is looked for remotely before anyone here computes it:
- `resolve` claims the chain's locally missing, unclaimed keys for the *proxy* (one session of
  the local singleflight that stands for the remote tier) and asks the worker to `Resolve` them;
  local askers wait on the proxy like on any leader;
- the worker answers `Resolved`: an entry found remotely is published here by the proxy (its
  waiters see hits); a key whose remote claim this machine took is released by the proxy, so its
  first waiter is promoted and leads it, as on a plain miss; a key another machine is computing
  (`busy`) stays the proxy's until that machine publishes it or its lease runs out (the worker
  keeps watching); a key the remote tier could not answer for (`failed`) is released too;
- a `lookup`'s local misses are `Probe`d remotely (claiming nothing) and answered `Probed`;
- every entry a local leader publishes is written through (`WriteThrough`) at once, with the
  remote claim it held (which the write then ends); the worker answers `Written` (stats count
  the writes still pending, done and refused); a remote claim held here whose local claim
  ended unpublished (or never began within `grace` seconds) is released (`Release`), so another
  machine's waiter takes over without waiting for the lease.
Write-through, not write-back: another machine may be waiting for the entry now, and an entry
already written survives this machine's store dying.
"""

from dataclasses import dataclass, field

from kmesh.store.remote.mooncake_tier import RemoteEntry
from kmesh.store.tier import EntryId


@dataclass(frozen=True, slots=True)
class Resolve:
    idents: tuple[EntryId, ...]


@dataclass(frozen=True, slots=True)
class WriteThrough:
    ident: EntryId
    segment: str  # the local entry's shared memory segment, read by the worker
    size: int
    checksum: int
    meta: bytes
    claim: int | None  # the remote claim's generation this machine held for it
    pin: bool  # published for a family: kept over unpinned entries remotely too


@dataclass(frozen=True, slots=True)
class Release:
    ident: EntryId
    claim: int


@dataclass(frozen=True, slots=True)
class Probe:
    """Which of these keys the remote tier holds (a `lookup`'s local misses; claims nothing)."""

    probe: int
    idents: tuple[EntryId, ...]


Command = Resolve | WriteThrough | Release | Probe


@dataclass(frozen=True, slots=True)
class Written:
    """A write-through ended: the entry is in the remote tier (or was refused: full, failed)."""

    ident: EntryId
    stored: bool


@dataclass(frozen=True, slots=True)
class Probed:
    probe: int
    found: tuple[bool, ...]  # all False if the remote tier did not answer


@dataclass(frozen=True, slots=True)
class Resolved:
    """The worker's answer for some keys (of one Resolve, or of keys it kept watching)."""

    fetched: tuple[tuple[EntryId, RemoteEntry], ...] = ()
    claimed: tuple[tuple[EntryId, int], ...] = ()  # (key, claim generation)
    busy: tuple[EntryId, ...] = ()
    failed: tuple[EntryId, ...] = ()


@dataclass(slots=True)
class _Held:
    claim: int
    since: float
    led: bool = False  # a local leader has had it


@dataclass(slots=True)
class RemoteFront:
    """Remote claims held by this machine and the commands for the worker (module docstring)."""

    grace: float
    held: dict[EntryId, _Held] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("fetched", "claimed", "busy", "failed", "written", "refused", "pending"), 0
        )
    )

    def take_commands(self) -> list[Command]:
        commands, self.commands = self.commands, []
        return commands

    def asks(self, ident: EntryId) -> bool:
        """Whether a locally missing, unclaimed key is to be resolved remotely first (not if
        this machine already holds its remote claim: then a local asker leads it)."""
        return ident not in self.held

    def resolve(self, idents: list[EntryId]) -> None:
        if idents:
            self.commands.append(Resolve(tuple(idents)))

    def claimed(self, ident: EntryId, claim: int, now: float) -> None:
        self.counts["claimed"] += 1
        self.held[ident] = _Held(claim, now)

    def published(
        self, ident: EntryId, segment: str, size: int, crc: int, meta: bytes, pin: bool
    ) -> None:
        """A local leader published `ident`: write it through, ending any remote claim."""
        held = self.held.pop(ident, None)
        claim = None if held is None else held.claim
        self.counts["pending"] += 1
        self.commands.append(WriteThrough(ident, segment, size, crc, meta, claim, pin))

    def written(self, done: Written) -> None:
        self.counts["pending"] -= 1
        self.counts["written" if done.stored else "refused"] += 1

    def tick(self, leaders: set[EntryId], now: float) -> None:
        """Release remote claims whose local claim ended unpublished, or never began within
        `grace`; `leaders`: the held keys that have a local leader now. Released newest claim
        first (a chain's tail before its head): another machine waiting on the head, promoted
        when it sees the head free, finds the rest of the chain free too and leads it whole."""
        for ident, held in reversed(list(self.held.items())):
            if ident in leaders:
                held.led = True
            elif held.led or now - held.since > self.grace:
                del self.held[ident]
                self.commands.append(Release(ident, held.claim))
