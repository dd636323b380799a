"""`Closing`: `with` for the store's client-side objects that hold something until `close`."""

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class Closing(ABC):
    """A base for a class with `close()`: `with obj:` gives `obj` and closes it on leaving the
    block, whether or not it raised (the exception is not swallowed)."""

    __slots__ = ()

    @abstractmethod
    def close(self) -> None:
        """Let go of what the object holds."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
