"""Singleflight and family pins without a store: keys are strings, entries a dict."""

from dataclasses import dataclass

from kmesh.coord.pins import FamilyPins
from kmesh.coord.singleflight import Singleflight

LEASE = 10.0


def flight(published: dict[str, str], cancelled: list[str]) -> Singleflight[str, str, str]:
    return Singleflight(published.get, cancelled.append, LEASE)


def test_a_second_asker_waits_and_sees_the_hit_once_the_leader_publishes():
    published: dict[str, str] = {}
    sf = flight(published, [])
    leader, waiter = sf.open(), sf.open()
    [led] = sf.acquire(leader, ["a", "b"], "first", deadline=0.0, now=0.0)
    assert (led.hits, led.lead, led.blocked) == ((), 2, False)
    assert sf.acquire(waiter, ["a", "b"], "second", deadline=5.0, now=0.0) == []
    assert waiter.waiting is not None and waiter.waiting.blocked_on == "a"
    published["a"] = "entry-a"
    assert sf.publish("a", now=1.0) == []  # the waiter now waits on b
    assert waiter.waiting is not None and waiter.waiting.blocked_on == "b"
    published["b"] = "entry-b"
    [seen] = sf.publish("b", now=1.0)
    assert (seen.session, seen.ask, seen.hits, seen.lead) == (
        waiter,
        "second",
        ("entry-a", "entry-b"),
        0,
    )
    assert sf.num_claims == 0 and sf.num_waiters == 0


def test_a_released_claim_cancels_its_reservation_and_promotes_the_first_waiter():
    cancelled: list[str] = []
    sf = flight({}, cancelled)
    leader, first, second = sf.open(), sf.open(), sf.open()
    sf.acquire(leader, ["a"], "l", deadline=0.0, now=0.0)
    sf.reserve("a", "segment-1")
    sf.acquire(first, ["a"], "f", deadline=5.0, now=0.0)
    sf.acquire(second, ["a"], "s", deadline=5.0, now=0.0)
    [promoted] = sf.release(["a"], now=1.0)
    assert cancelled == ["segment-1"]
    assert (promoted.session, promoted.lead) == (first, 1) and sf.leader("a") is first
    assert second.waiting is not None and second.waiting.blocked_on == "a"
    assert sf.num_promoted == 1


def test_a_lease_that_runs_out_releases_the_claims_and_a_wait_that_runs_out_is_answered():
    sf = flight({}, [])
    leader, waiter = sf.open(), sf.open()
    sf.acquire(leader, ["a"], "l", deadline=0.0, now=0.0)
    sf.touch(leader, now=0.0)
    sf.acquire(waiter, ["a"], "w", deadline=2.0, now=0.0)
    assert sf.next_deadline() == 2.0
    [blocked] = sf.expire(now=2.0)
    assert (blocked.session, blocked.lead, blocked.blocked) == (waiter, 0, True)
    sf.acquire(waiter, ["a"], "w", deadline=60.0, now=3.0)
    [promoted] = sf.expire(now=LEASE)
    assert (promoted.session, promoted.lead) == (waiter, 1)
    assert sf.num_expired == 1 and not leader.claims


@dataclass(frozen=True)
class _Entry:
    serial: int


class _Tier:
    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.pins: list[str] = []
        self.unpins: list[tuple[str, int, float | None]] = []
        self.dates: list[tuple[str, float | None]] = []

    def lookup(self, ident: str) -> _Entry | None:
        return self.entries.get(ident)

    def pin(self, ident: str, next_use: float | None) -> None:
        self.pins.append(ident)
        self.dates.append((ident, next_use))

    def declare(self, ident: str, next_use: float, was: float | None) -> None:
        self.dates.append((ident, next_use))

    def unpin(self, ident: str, serial: int, was: float | None) -> None:
        self.unpins.append((ident, serial, was))


def test_an_entry_is_pinned_once_per_family_and_its_close_unpins_it():
    tier = _Tier()
    pins: FamilyPins[str] = FamilyPins(tier)
    session = flight({}, []).open()
    assert not pins.pin(session, "f", "a")  # nothing published: nothing pinned
    tier.entries["a"] = _Entry(serial=7)
    assert pins.pin(session, "f", "a") and pins.pin(session, "f", "a")
    assert pins.pin(session, "g", "a", next_use=3)
    assert pins.pin(session, "g", "a", next_use=5)  # pinned already: only dated anew
    assert tier.pins == ["a", "a"]  # once for f, once for g
    assert tier.dates == [("a", None), ("a", 3), ("a", 5)]
    assert pins.close(session, "f") == 1 and tier.unpins == [("a", 7, None)]
    pins.close_all(session)  # g's pin goes back with the date it last declared
    assert tier.unpins == [("a", 7, None), ("a", 7, 5)] and session.pins == {}
