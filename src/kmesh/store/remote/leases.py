"""Whether another machine's remote claim is still alive, judged by this machine's clock alone.

A claim's holder raises its record's beat while it lives (worker.py). An observer that
sees the same (generation, beat) for `lease` seconds of its own monotonic clock takes the holder
for dead; clocks of different machines are never compared, so no clock sync is assumed. A
holder that beats at least every lease / 3 is never taken for dead by a live observer. No I/O.
"""

from dataclasses import dataclass, field

from kmesh.store.tier import EntryId


@dataclass(slots=True)
class ForeignLeases:
    lease: float
    _seen: dict[EntryId, tuple[tuple[int, int], float]] = field(default_factory=dict)

    def expired(self, ident: EntryId, generation: int, beat: int, now: float) -> bool:
        """Whether the claim (generation, beat) of `ident` has not moved for `lease` seconds
        since this observer first saw it so."""
        mark = (generation, beat)
        seen = self._seen.get(ident)
        if seen is None or seen[0] != mark:
            self._seen[ident] = (mark, now)
            return False
        return now - seen[1] >= self.lease

    def forget(self, ident: EntryId) -> None:
        self._seen.pop(ident, None)
