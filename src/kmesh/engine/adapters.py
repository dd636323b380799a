"""The engine's adapters: which one a request runs under, from where, and whose state it may fork.

State never crosses adapters, with one exact exception: an activated adapter's tokens before its
invocation are the base model's state (compute/lora.py). So a request may fork a state of its own
adapter (keeping that state's activation, as generated tokens do), or, under an activated adapter,
a base-model state when its invocation lies wholly in the fork's own tokens (the last occurrence on
the whole sequence then starts after every trunk token). Prefix blocks follow the same rule by key
(engine/kv_manager.py::extend_keys).
"""

from collections.abc import Iterable

from kmesh.compute.lora import LoraAdapter, LoraUse
from kmesh.engine.request import Request
from kmesh.engine.sequence import Sequence
from kmesh.errors import InvalidRequestError


class Adapters:
    def __init__(self, adapters: Iterable[LoraAdapter]) -> None:
        self._by_name: dict[str, LoraAdapter] = {}
        for adapter in adapters:
            if adapter.name in self._by_name:
                raise InvalidRequestError(
                    f"two adapters are named {adapter.name!r}: give each its own name"
                )
            self._by_name[adapter.name] = adapter

    def check(self, request: Request) -> None:
        """Refuse a request naming an adapter that is not loaded."""
        if request.adapter is not None and request.adapter not in self._by_name:
            loaded = ", ".join(sorted(self._by_name)) or "none"
            raise InvalidRequestError(
                f"adapter {request.adapter!r} is not loaded (loaded: {loaded}): name a loaded "
                "adapter, or leave it out for the base model"
            )

    def of(self, request: Request) -> LoraAdapter | None:
        return None if request.adapter is None else self._by_name[request.adapter]

    def use(self, request: Request) -> LoraUse | None:
        """How a request that forks nothing runs: its adapter from where it activates."""
        return LoraUse.of(self.of(request), request.prompt_ids)

    def may_fork(self, request: Request, parent_adapter: str | None) -> bool:
        """Whether `request` may fork a state computed under `parent_adapter` (module docstring)."""
        if request.adapter == parent_adapter:
            return True
        adapter = self.of(request)
        if parent_adapter is not None or adapter is None or not adapter.activated:
            return False
        return adapter.activation_start(request.prompt_ids) is not None

    def fork_use(self, request: Request, parent: Sequence) -> LoraUse | None:
        """How a fork (allowed by may_fork) of `parent` runs."""
        if request.adapter == parent.request.adapter:
            return parent.lora
        use = LoraUse.of(self.of(request), request.prompt_ids)
        assert use is not None
        return LoraUse(use.adapter, len(parent.token_ids) + use.start)
