"""The store as a state machine, with no sockets: protocol requests in, answers out.

Sessions (one per connection) send requests and get answers, some of them later (a waiting
`acquire`) or to other sessions (a `commit` wakes the waiters of its key). The coordination is
kmesh/coord/: singleflight (claims, waiters, promotion, leases) and family pins; this module
files entries in a tier, scopes requests by tenant and speaks the protocol. A key of a tenant is:

    absent --acquire--> claimed (one leader) --reserve, commit--> published --evict/drop--> absent
    claimed --abandon, refused reserve, leader gone, lease run out--> absent (+ a waiter promoted)

Entries are filed under (key, tenant): a tenant's lookup never sees another's entry, claim or
waiters, so its answers are those of a plain miss. With API keys (kmesh/state/tenants.py), a
connection's first request is a `hello` with a key (anything else, or an unknown key, gets an
`unauthorized` error), and the key's tenant scopes every later request: the `tenant` a client
names only subdivides its key's (tenant_salt), so no client can name another key's entries.

With a remote tier (`remote`, remote/front.py), an acquire's locally missing keys are first
claimed by the front's proxy session and looked up remotely; the asker waits on the proxy (up to
`remote_wait` seconds, even if it asked not to wait: a remote lookup is part of a lookup) and then
sees a hit (fetched) or leads (nobody has it). A `lookup` also names the keys the remote tier holds
(asked of it, claiming nothing; answered with what is local after `remote_wait`). Fed the worker's
answers by `remote_done`.
"""

from dataclasses import dataclass

import msgspec

from kmesh.coord.pins import FamilyPins
from kmesh.coord.singleflight import Answer, Session, Singleflight
from kmesh.state.tenants import ApiKeys, tenant_salt
from kmesh.store.protocol import (
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
    Found,
    Hello,
    HitInfo,
    Lookup,
    Pin,
    Ping,
    Prefault,
    Refused,
    Request,
    Reserve,
    Reserved,
    Spares,
    Stats,
    StatsInfo,
    Warmed,
)
from kmesh.store.remote.front import Probe, Probed, RemoteFront, Resolved, Written
from kmesh.store.tier import CapacityError, EntryId, StoredEntry, Tier

DEFAULT_LEASE_S = 60.0
DEFAULT_REMOTE_WAIT_S = 2.0  # well under a client's default timeout (5 s)

StoreSession = Session[EntryId, Acquire]
Outbox = list[tuple[StoreSession, AnyAnswer]]


class Store:
    """Protocol requests over a tier, coordinated by kmesh/coord/; see the module docstring."""

    def __init__(
        self,
        tier: Tier,
        lease: float = DEFAULT_LEASE_S,
        api_keys: ApiKeys | None = None,
        remote: RemoteFront | None = None,
        remote_wait: float = DEFAULT_REMOTE_WAIT_S,
    ) -> None:
        self.tier = tier
        self.lease = lease
        self.api_keys = api_keys
        self.flight: Singleflight[EntryId, StoredEntry, Acquire] = Singleflight(
            tier.lookup, tier.cancel, lease
        )
        self.pins = FamilyPins(tier)
        self._tenants: dict[StoreSession, str | None] = {}  # API key tenants, once said hello
        self._counts = dict.fromkeys(("hits", "misses", "published", "refused"), 0)
        self.remote = remote
        self.remote_wait = remote_wait
        self._proxy = self.flight.open()  # leads the keys being looked up remotely
        self._probes: dict[int, _Probe] = {}  # lookups waiting for the remote tier
        self._next_probe = 0

    @property
    def sessions(self) -> set[StoreSession]:
        return self.flight.sessions

    def open(self) -> StoreSession:
        return self.flight.open()

    def handle(self, session: StoreSession, request: AnyRequest, now: float) -> Outbox:
        """Answers to send: this session's (unless it now waits) and any it caused others."""
        if self.api_keys is not None:
            scoped = self._authorized(session, request)
            if not isinstance(scoped, Request):
                return [(session, scoped)]
            request = scoped
        out: Outbox = []
        self.flight.touch(session, now)
        match request:
            case Acquire(keys=keys, tenant=tenant):
                idents = [(key, tenant) for key in keys]
                deadline = now + request.wait
                if self.remote is not None and self._resolve(idents, now):
                    deadline = max(deadline, now + self.remote_wait)
                out += self._answers(self.flight.acquire(session, idents, request, deadline, now))
            case Lookup(keys=keys, tenant=tenant):
                present = [i for i, k in enumerate(keys) if self.tier.lookup((k, tenant))]
                local = set(present)
                missing = [i for i in range(len(keys)) if i not in local]
                if self.remote is None or not missing:
                    out.append((session, Found(present=present)))
                else:
                    self._next_probe += 1
                    probe = _Probe(session, present, missing, now + self.remote_wait)
                    self._probes[self._next_probe] = probe
                    probed = tuple((keys[i], tenant) for i in missing)
                    self.remote.commands.append(Probe(self._next_probe, probed))
            case Reserve(key=key, tenant=tenant, size=size):
                out.append((session, self._reserve(session, (key, tenant), size, now, out)))
            case Commit():
                out.append((session, self._commit(session, request, now, out)))
            case Abandon(keys=keys, tenant=tenant):
                named = dict.fromkeys((k, tenant) for k in keys)
                mine = [ident for ident in named if self.flight.leader(ident) is session]
                out += self._answers(self.flight.release(mine, now))
                out.append((session, Done(count=len(mine))))
            case Pin(family=family, keys=keys, tenant=tenant, next_use=next_use):
                count = sum(self.pins.pin(session, family, (k, tenant), next_use) for k in keys)
                out.append((session, Done(count=count)))
            case CloseFamily(family=family):
                out.append((session, Done(count=self.pins.close(session, family))))
            case Drop(key=key, tenant=tenant, name=name):
                out.append((session, Done(count=int(self.tier.drop((key, tenant), name)))))
            case Stats():
                out.append((session, self._stats()))
            case Prefault(size=size, count=count):
                out.append((session, Spares(names=self.tier.make_spares(size, count))))
            case Warmed(names=names):
                out.append((session, Done(count=self.tier.warmed(names))))
            case Ping() | Hello():
                out.append((session, Done()))
        return out

    def busy(self, session: StoreSession) -> bool:
        """Whether the session awaits an answer (a waiting acquire, a lookup probing remotely):
        its next request is not taken before."""
        return session.waiting is not None or any(
            p.session is session for p in self._probes.values()
        )

    def close(self, session: StoreSession, now: float) -> Outbox:
        """The session's connection is gone: stop its wait, release its pins and claims."""
        for number in [n for n, p in self._probes.items() if p.session is session]:
            del self._probes[number]
        self.pins.close_all(session)
        self._tenants.pop(session, None)
        return self._answers(self.flight.close(session, now))

    def expire(self, now: float) -> Outbox:
        """Release the claims of sessions whose lease ran out (promoting waiters), then answer
        waits that ran out."""
        if self.remote is not None:
            self.flight.touch(self._proxy, now)
            leaders = {
                i for i in self.remote.held if self.flight.leader(i) not in (None, self._proxy)
            }
            self.remote.tick(leaders, now)
        out: Outbox = []
        for number in [n for n, p in self._probes.items() if p.deadline <= now]:
            out.append(self._probes.pop(number).answer(()))  # the local answer, in time
        return out + self._answers(self.flight.expire(now))

    def remote_done(self, resolved: Resolved | Probed | Written, now: float) -> Outbox:
        """The remote worker's answer: a probing lookup answered; fetched entries published here
        by the proxy, claimed and failed keys released to local waiters, waiters that asked not
        to wait on another machine answered."""
        assert self.remote is not None
        out: Outbox = []
        if isinstance(resolved, Written):
            self.remote.written(resolved)
            return out
        if isinstance(resolved, Probed):
            probe = self._probes.pop(resolved.probe, None)
            return [] if probe is None else [probe.answer(resolved.found)]
        counts = self.remote.counts
        release = [ident for ident, _ in resolved.claimed] + list(resolved.failed)
        for ident, entry in resolved.fetched:
            if self.flight.leader(ident) is not self._proxy:
                continue
            try:
                name = self.tier.reserve(len(entry.payload))
            except CapacityError:
                release.append(ident)
                continue
            self.tier.fill(name, entry.payload)
            self.flight.reserve(ident, name)
            self.tier.commit(ident, name, entry.checksum, entry.meta)
            counts["fetched"] += 1
            out += self._answers(self.flight.publish(ident, now))
        for ident, claim in resolved.claimed:
            self.remote.claimed(ident, claim, now)
        counts["failed"] += len(resolved.failed)
        counts["busy"] += len(resolved.busy)
        mine = [ident for ident in release if self.flight.leader(ident) is self._proxy]
        out += self._answers(self.flight.release(mine, now))
        for ident in resolved.busy:
            out += self._answers(self.flight.unblock(ident, now, lambda ask: ask.wait == 0))
        return out

    def next_deadline(self) -> float | None:
        deadlines = [p.deadline for p in self._probes.values()]
        flight = self.flight.next_deadline()
        return min(deadlines + ([] if flight is None else [flight]), default=None)

    def _resolve(self, idents: list[EntryId], now: float) -> bool:
        """Claim the chain's locally missing, unclaimed keys for the proxy and ask the remote
        tier for them; whether the first missing key is now the proxy's. Each key is looked up
        once here: the proxy claims what this lookup found missing (Singleflight.claim)."""
        assert self.remote is not None
        missing = [i for i in idents if self.tier.lookup(i) is None]
        asked = []
        for ident in missing:
            if self.flight.leader(ident) is None and self.remote.asks(ident):
                self.flight.claim(self._proxy, ident, now)
                asked.append(ident)
        self.remote.resolve(asked)
        return bool(missing) and self.flight.leader(missing[0]) is self._proxy

    def _authorized(self, session: StoreSession, request: AnyRequest) -> AnyRequest | AnyAnswer:
        """The request in its session's tenant, or the answer refusing it."""
        assert self.api_keys is not None
        if isinstance(request, Hello):
            self._tenants[session] = self.api_keys.tenant_of_key(request.key)
        tenant = self._tenants.get(session)
        if tenant is None:
            if isinstance(request, Hello):
                return Error(code="unauthorized", message="the API key is not valid")
            return Error(code="unauthorized", message="send a hello with an API key first")
        return msgspec.structs.replace(request, tenant=tenant_salt(tenant, request.tenant))

    def _answers(self, answers: list[Answer[EntryId, StoredEntry, Acquire]]) -> Outbox:
        """Evaluated acquires as protocol answers; a request's hits pinned for its family."""
        out: Outbox = []
        for answer in answers:
            if answer.session is self._proxy:
                continue
            family = answer.ask.family
            if family is not None:
                for ident in answer.keys[: len(answer.hits)]:
                    self.pins.pin(answer.session, family, ident)
            self._counts["hits"] += len(answer.hits)
            self._counts["misses"] += answer.lead
            infos = [HitInfo(e.name, e.size, e.checksum, e.meta) for e in answer.hits]
            acquired = Acquired(hits=infos, lead=answer.lead, wait=answer.blocked, lease=self.lease)
            out.append((answer.session, acquired))
        return out

    def _reserve(
        self, session: StoreSession, ident: EntryId, size: int, now: float, out: Outbox
    ) -> AnyAnswer:
        if self.flight.leader(ident) is not session:
            return _not_leader()
        self.flight.reserve(ident, None)
        try:
            name = self.tier.reserve(size)
        except CapacityError as error:
            self._counts["refused"] += 1
            out += self._answers(self.flight.release([ident], now))
            return Refused(code=error.code, reason=f"{error}; the key's claim was released")
        self.flight.reserve(ident, name)
        return Reserved(name=name)

    def _commit(self, session: StoreSession, request: Commit, now: float, out: Outbox) -> AnyAnswer:
        ident = (request.key, request.tenant)
        if self.flight.leader(ident) is not session:
            return _not_leader()
        name = self.flight.reservation(ident)
        if name is None:
            return Refused(code="not_reserved", reason="commit before reserve: nothing was written")
        entry = self.tier.commit(ident, name, request.checksum, request.meta)
        self._counts["published"] += 1
        if self.remote is not None:
            pin = request.family is not None
            self.remote.published(ident, name, entry.size, request.checksum, request.meta, pin)
        if request.family is not None:
            self.pins.pin(session, request.family, ident, request.next_use)
        out += self._answers(self.flight.publish(ident, now))
        return Done(count=1)

    def _stats(self) -> StatsInfo:
        tier = self.tier.stats()
        return StatsInfo(
            capacity=tier.capacity,
            used=tier.used,
            entries=tier.entries,
            pinned=tier.pinned,
            reserved=tier.reserved,
            spares=tier.spares,
            claims=self.flight.num_claims,
            waiters=self.flight.num_waiters,
            connections=len(self.sessions) - 1,  # not the proxy
            evicted=tier.evicted,
            dropped=tier.dropped,
            promoted=self.flight.num_promoted,
            expired=self.flight.num_expired,
            **self._counts,
            **(
                {}
                if self.remote is None
                else {f"remote_{k}": v for k, v in self.remote.counts.items()}
            ),
        )


@dataclass(frozen=True, slots=True)
class _Probe:
    """A lookup whose local misses the remote tier is asked about."""

    session: StoreSession
    present: list[int]  # indices published locally
    missing: list[int]  # indices probed remotely, in order
    deadline: float  # answered with what is local by then

    def answer(self, found: tuple[bool, ...]) -> tuple[StoreSession, AnyAnswer]:
        remote = [i for i, there in zip(self.missing, found, strict=False) if there]
        return self.session, Found(present=sorted(self.present + remote))


def _not_leader() -> Refused:
    return Refused(
        code="not_leader",
        reason="this connection does not hold the key's claim (it was published, abandoned, "
        "refused, or its lease ran out)",
    )
