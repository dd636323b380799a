"""Family pins: a session's family declares it will read entries again (retention by future use,
future_use.py: the tier keeps them longest, soft, or never evicts them under lru).

A pin belongs to a (session, family) and names one entry (its serial), not just its key: a key
published again after an eviction is a new entry, pinned anew. It holds the family's latest
declared next use, which the tier is told again when the pin is dated anew or taken back.
`close` (the family ended) or `close_all` (the session ended) takes the session's pins back, so a
dead client cannot pin state forever. Entries live in a tier (`PinTarget`); this is bookkeeping
only, no I/O.
"""

from typing import Any, Generic, Protocol, TypeVar

from kmesh.coord.singleflight import Key, Session

_Ident = TypeVar("_Ident", contravariant=True)


class Pinned(Protocol):
    @property
    def serial(self) -> int: ...


class PinTarget(Protocol[_Ident]):
    """Where the entries live (a store tier)."""

    def lookup(self, ident: _Ident, /) -> Pinned | None: ...

    def pin(self, ident: _Ident, next_use: float | None, /) -> object: ...

    def declare(self, ident: _Ident, next_use: float, was: float | None, /) -> None: ...

    def unpin(self, ident: _Ident, serial: int, was: float | None, /) -> None: ...


class FamilyPins(Generic[Key]):
    """Pins by (session, family) over `target`; each entry pinned once per family."""

    def __init__(self, target: PinTarget[Key]) -> None:
        self.target = target

    def pin(
        self,
        session: Session[Key, Any],
        family: str,
        ident: Key,
        next_use: float | None = None,
    ) -> bool:
        """Pin the published entry of `ident` for the session's `family`, declaring its next
        use (a family that pinned it already only dates it anew); False if there is none."""
        entry = self.target.lookup(ident)
        if entry is None:
            return False
        pins = session.pins.setdefault(family, {})
        held = pins.get(ident)
        if held is None or held[0] != entry.serial:
            self.target.pin(ident, next_use)
            pins[ident] = (entry.serial, next_use)
        elif next_use is not None:
            self.target.declare(ident, next_use, held[1])
            pins[ident] = (entry.serial, next_use)
        return True

    def close(self, session: Session[Key, Any], family: str) -> int:
        """The family ended for the session: unpin its entries; returns how many it had."""
        pins = session.pins.pop(family, {})
        for ident, (serial, next_use) in pins.items():
            self.target.unpin(ident, serial, next_use)
        return len(pins)

    def close_all(self, session: Session[Key, Any]) -> None:
        """The session ended: every family of it ends."""
        for family in list(session.pins):
            self.close(session, family)
