"""Singleflight: one computation per missing key, however many sessions ask for it.

A session (one store connection) asks for a chain of keys, each standing for its whole prefix.
For one key:

    absent --acquire--> claimed (one leader) --reserve, publish--> published (`lookup` finds it)
    claimed --release (abandon, refused, leader gone, lease run out)--> absent (+ waiter promoted)

`acquire` walks the chain: the published prefix is answered as hits; if the first missing key is
claimed by another session, the session waits for it (until its deadline); otherwise it claims it
and every following key that is neither published nor claimed. Waiters of a key are kept in
arrival order. When the key is published they all see it as a hit (and go on down their chain);
when its claim is released they are re-evaluated in order, so the first becomes the new leader and
the rest keep waiting, on it. Nothing is computed twice while a leader lives, and no waiter is
left behind when a leader dies. A session's lease is renewed by each of its requests (`touch`)
and by leading; a session whose lease runs out loses its claims as if it had released them.

No I/O and no clock: every call is given `now`. Entries live elsewhere (a store tier): `lookup`
says what is published, and `cancel` frees the space a leader reserved (`reserve`) for a claim that
ends unpublished. Each evaluation is answered as an `Answer`, to the session that asked or,
later, to a waiter a publish or release woke.
"""

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Entry = TypeVar("Entry")
Ask = TypeVar("Ask")  # what the caller asked with, handed back with its answer


@dataclass(frozen=True, slots=True)
class Wait(Generic[Key, Ask]):
    """A parked acquire: its chain, until when it waits, and the key it waits for."""

    keys: tuple[Key, ...]
    ask: Ask
    deadline: float
    blocked_on: Key


@dataclass(eq=False, slots=True)
class Session(Generic[Key, Ask]):
    """One client of the singleflight (a store connection) and what it holds."""

    claims: dict[Key, None] = field(default_factory=dict)  # a set, in claim order
    lease_deadline: float = 0.0
    # family -> pinned key -> (the entry's serial, the next use the pin declared)
    pins: dict[str, dict[Key, tuple[int, float | None]]] = field(default_factory=dict)
    waiting: Wait[Key, Ask] | None = None


@dataclass(eq=False, slots=True)
class _Claim(Generic[Key, Ask]):
    leader: Session[Key, Ask]
    reservation: str | None = None  # space being written, once the leader reserved


@dataclass(frozen=True, slots=True)
class Answer(Generic[Key, Entry, Ask]):
    """An evaluated acquire: `hits` are the published prefix of its chain; then the session
    leads the next `lead` keys, or (`blocked`) another session leads the next one and the wait
    ran out."""

    session: Session[Key, Ask]
    ask: Ask
    keys: tuple[Key, ...]
    hits: tuple[Entry, ...]
    lead: int
    blocked: bool


class Singleflight(Generic[Key, Entry, Ask]):
    """Claims, waiters and leases; see the module docstring.

    Invariants: a key has at most one leader, and is never both claimed and published; a
    session waits on at most one key, and is in that key's waiter list exactly while it waits.
    """

    def __init__(
        self, lookup: Callable[[Key], Entry | None], cancel: Callable[[str], None], lease: float
    ) -> None:
        if not lease > 0:  # NaN too
            raise ValueError(f"lease must be positive, got {lease}")
        self.lookup = lookup
        self.cancel = cancel
        self.lease = lease
        self.sessions: set[Session[Key, Ask]] = set()
        self._claims: dict[Key, _Claim[Key, Ask]] = {}
        self._waiters: dict[Key, list[Session[Key, Ask]]] = {}
        self.num_promoted = 0  # waiters that became leaders when a claim was released
        self.num_expired = 0  # claims released because their leader's lease ran out

    @property
    def num_claims(self) -> int:
        return len(self._claims)

    @property
    def num_waiters(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())

    def open(self) -> Session[Key, Ask]:
        session: Session[Key, Ask] = Session()
        self.sessions.add(session)
        return session

    def touch(self, session: Session[Key, Ask], now: float) -> None:
        """The session made a request: its lease runs from now."""
        session.lease_deadline = now + self.lease

    def leader(self, key: Key) -> Session[Key, Ask] | None:
        claim = self._claims.get(key)
        return None if claim is None else claim.leader

    def reservation(self, key: Key) -> str | None:
        """The space reserved for the claim of `key` (None: unclaimed, or not reserved yet)."""
        claim = self._claims.get(key)
        return None if claim is None else claim.reservation

    def reserve(self, key: Key, name: str | None) -> None:
        """Record the space the leader of `key` reserved (None: none), cancelling any before."""
        claim = self._claims[key]
        if claim.reservation is not None:
            self.cancel(claim.reservation)
        claim.reservation = name

    def acquire(
        self, session: Session[Key, Ask], keys: Sequence[Key], ask: Ask, deadline: float, now: float
    ) -> list[Answer[Key, Entry, Ask]]:
        """Evaluate the chain `keys` for `session`: its answer, or none while it waits (until
        `deadline`) on another session's claim."""
        out: list[Answer[Key, Entry, Ask]] = []
        self._evaluate(session, tuple(keys), ask, deadline, now, out)
        return out

    def claim(self, session: Session[Key, Ask], key: Key, now: float) -> None:
        """Make `session` the leader of `key`, which the caller has just found neither published
        (`lookup`) nor claimed (`leader`): no evaluation, no answer, no second lookup."""
        assert self.leader(key) is None
        self._claims[key] = _Claim(session)
        session.claims[key] = None
        self.touch(session, now)

    def publish(self, key: Key, now: float) -> list[Answer[Key, Entry, Ask]]:
        """The leader published `key` into its reservation (`lookup` finds it now): its claim
        ends, its waiters are re-evaluated."""
        claim = self._claims.pop(key)
        del claim.leader.claims[key]
        out: list[Answer[Key, Entry, Ask]] = []
        self._wake(key, now, out)
        return out

    def release(self, keys: Sequence[Key], now: float) -> list[Answer[Key, Entry, Ask]]:
        """Claims that end without a publish: the keys are absent again. All go before any
        waiter is re-evaluated, so a promoted waiter can lead the whole chain its leader had."""
        out: list[Answer[Key, Entry, Ask]] = []
        self._release(keys, now, out)
        return out

    def close(self, session: Session[Key, Ask], now: float) -> list[Answer[Key, Entry, Ask]]:
        """The session is gone: stop its wait, release its claims (its pins are the caller's)."""
        if session.waiting is not None:
            self._unwait(session)
        out: list[Answer[Key, Entry, Ask]] = []
        self._release(list(session.claims), now, out)
        self.sessions.discard(session)
        return out

    def expire(self, now: float) -> list[Answer[Key, Entry, Ask]]:
        """Release the claims of sessions whose lease ran out (promoting waiters), then answer
        waits that ran out."""
        out: list[Answer[Key, Entry, Ask]] = []
        for session in list(self.sessions):
            if session.claims and session.lease_deadline <= now:
                self.num_expired += len(session.claims)
                self._release(list(session.claims), now, out)
        for session in list(self.sessions):
            wait = session.waiting
            if wait is not None and wait.deadline <= now:
                self._unwait(session)
                self._evaluate(session, wait.keys, wait.ask, now, now, out)
        return out

    def unblock(
        self, key: Key, now: float, which: Callable[[Ask], bool]
    ) -> list[Answer[Key, Entry, Ask]]:
        """Answer now (as blocked) the waiters of `key` whose ask `which` selects; the rest keep
        waiting."""
        out: list[Answer[Key, Entry, Ask]] = []
        for waiter in list(self._waiters.get(key, [])):
            wait = waiter.waiting
            assert wait is not None
            if which(wait.ask):
                self._unwait(waiter)
                self._evaluate(waiter, wait.keys, wait.ask, now, now, out)
        return out

    def next_deadline(self) -> float | None:
        """The earliest lease or wait that runs out, if any."""
        deadlines = [s.lease_deadline for s in self.sessions if s.claims]
        deadlines += [s.waiting.deadline for s in self.sessions if s.waiting is not None]
        return min(deadlines, default=None)

    def _evaluate(
        self,
        session: Session[Key, Ask],
        keys: tuple[Key, ...],
        ask: Ask,
        deadline: float,
        now: float,
        out: list[Answer[Key, Entry, Ask]],
    ) -> int:
        """Answer `keys` for `session`, or park it until `deadline`; returns how many keys the
        session now leads."""
        hits: list[Entry] = []
        for key in keys:
            entry = self.lookup(key)
            if entry is None:
                break
            hits.append(entry)
        rest = keys[len(hits) :]
        blocked = None
        if rest:
            leader = self.leader(rest[0])
            if leader is not None and leader is not session:
                blocked = rest[0]
        if blocked is not None and deadline > now:
            session.waiting = Wait(keys, ask, deadline, blocked)
            self._waiters.setdefault(blocked, []).append(session)
            return 0
        lead = 0
        if blocked is None:
            for i, key in enumerate(rest):
                leader = self.leader(key)
                # NOTE: rest[0] was just looked up (the miss that ended the hits): not again.
                if leader is None and (i == 0 or self.lookup(key) is None):
                    self._claims[key] = _Claim(session)
                    session.claims[key] = None
                elif leader is not session:
                    break
                lead += 1
        if lead:
            self.touch(session, now)
        out.append(Answer(session, ask, keys, tuple(hits), lead, blocked is not None))
        return lead

    def _unwait(self, session: Session[Key, Ask]) -> None:
        assert session.waiting is not None
        key = session.waiting.blocked_on
        waiters = self._waiters[key]
        waiters.remove(session)
        if not waiters:
            del self._waiters[key]
        session.waiting = None

    def _wake(self, key: Key, now: float, out: list[Answer[Key, Entry, Ask]]) -> int:
        """Re-evaluate the waiters of `key` in arrival order; returns how many now lead."""
        promoted = 0
        for waiter in self._waiters.pop(key, []):
            wait = waiter.waiting
            assert wait is not None
            waiter.waiting = None
            promoted += self._evaluate(waiter, wait.keys, wait.ask, wait.deadline, now, out) > 0
        return promoted

    def _release(self, keys: Sequence[Key], now: float, out: list[Answer[Key, Entry, Ask]]) -> None:
        for key in keys:
            claim = self._claims.pop(key)
            del claim.leader.claims[key]
            if claim.reservation is not None:
                self.cancel(claim.reservation)
        for key in keys:
            self.num_promoted += self._wake(key, now, out)
