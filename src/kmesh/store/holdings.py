"""What a store client holds on its connection: the bookkeeping behind StoreClient.holding.

No I/O. The store ties two things to a connection and lets them go when it closes: a family's
pins, and the claims it leads (with their reservations). A client records them from the store's
answers: a claim from an acquire or wait that leads keys until commit, abandon, a refused
reserve or commit (`not_leader`), or its lease running out with no request from the client; a
family from pin, or acquire/commit with a family, until close_family. Reads are not held: a
read's mapping is not the connection's.

Invariant: `lease_end` is measured from after each answer with the lease the store last sent,
so it is never earlier than the store's own end of the claims.
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Holdings:
    """One connection's pins and claims, as its answers told them."""

    # Keys the store answered this client leads, not yet let go.
    led: set[bytes] = field(default_factory=set)
    # Families it pinned entries for, not yet closed.
    families: set[str] = field(default_factory=set)
    # The store's lease (seconds), from its last Acquired answer.
    lease: float = 0.0
    # Monotonic time by which the store has let the claims go.
    lease_end: float = 0.0

    def any(self, now: float | None = None) -> bool:
        """Whether something would be let go if the connection closed at `now`."""
        now = time.monotonic() if now is None else now
        return bool(self.families) or (bool(self.led) and now < self.lease_end)

    def renewed(self) -> None:
        """A request reached the store: every claim's lease starts again."""
        self.lease_end = time.monotonic() + self.lease

    def leading(self, keys: Iterable[bytes], lease: float) -> None:
        """An acquire answered: the client leads `keys` for `lease` seconds."""
        self.lease = lease
        self.renewed()
        self.led.update(keys)

    def let_go(self, keys: Iterable[bytes]) -> None:
        """Claims ended: committed, abandoned or refused."""
        self.led.difference_update(keys)

    def clear(self) -> None:
        """The connection closed: the store let everything go."""
        self.led.clear()
        self.families.clear()
