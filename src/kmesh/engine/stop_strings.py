"""Stop strings (OpenAI's `stop`): where generated text ends, the same rule for both engines and
the server. The text ends before the earliest occurrence of any stop string; a stream may send
text only up to where a stop string could still be starting."""

from collections.abc import Sequence


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where `text` ends: the start of the earliest stop string in it, or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (not safe to send)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


class StopFilter:
    """The text of a response as it is decoded: what may be sent now (`feed`), and the rest at
    the end (`flush`). Nothing from the first stop string on is ever sent."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.stopped = False  # a stop string was found: the text ended before it
        self._pending = ""

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self._pending += text
        cut = first_stop(self._pending, self.stops)
        # The earliest position where a stop string may be starting without being complete yet:
        # a complete one after it does not end the text until that one is decided.
        ready = len(self._pending) - held_back(self._pending, self.stops)
        if cut is not None and cut <= ready:
            sent, self._pending, self.stopped = self._pending[:cut], "", True
            return sent
        sent, self._pending = self._pending[:ready], self._pending[ready:]
        return sent

    def flush(self) -> str:
        """The rest at the end of the text: up to the first stop string it holds."""
        cut = first_stop(self._pending, self.stops) if self.stops else None
        sent = self._pending if cut is None else self._pending[:cut]
        self._pending, self.stopped = "", self.stopped or cut is not None
        return sent
