"""Retained states and the forks waiting for them.

A request sent with `retain` stays, once computed, as a state other requests may fork; a fork
sent before its trunk is computed waits here until the trunk is retained. Each retained state
keeps its tenant salt and adapter: a fork must carry the same salt, and an adapter that may fork
the state's (engine/adapters.py), since state never crosses tenants or adapters.
"""

from collections import defaultdict

from kmesh.engine.adapters import Adapters
from kmesh.engine.request import Request
from kmesh.engine.sequence import Sequence
from kmesh.errors import ContractError


class RetainedStates:
    """Retained sequences by state id, and forks queued for trunks not retained yet.

    Invariant: a state's salt and adapter are known from when its request is added until the
    state is dropped, so a fork sent meanwhile (queued or not) is checked against them.
    """

    def __init__(self, adapters: Adapters) -> None:
        self._adapters = adapters
        self._retained: dict[str, Sequence] = {}
        # Forks of declared trunks that are not computed yet, started when the trunk is retained.
        self._queued_forks: defaultdict[str, list[Request]] = defaultdict(list)
        # Tenant salt of every retained (forkable) state: forks must carry the same.
        self._state_salts: dict[str, str | None] = {}
        # Adapter of every retained state (None: the base model).
        self._state_adapters: dict[str, str | None] = {}

    def __contains__(self, state_id: str) -> bool:
        return state_id in self._retained

    def get(self, state_id: str) -> Sequence:
        """A retained state; raises ContractError when there is none of that id."""
        if state_id not in self._retained:
            raise ContractError(f"state {state_id!r} is not retained")
        return self._retained[state_id]

    def expect(self, request: Request) -> None:
        """Remember the salt and adapter of a request that will be retained."""
        self._state_salts[request.request_id] = request.tenant_salt
        self._state_adapters[request.request_id] = request.adapter

    def add(self, seq: Sequence) -> list[Request]:
        """Retain a computed sequence; the forks that waited for it, to start now."""
        state_id = seq.request.request_id
        self._retained[state_id] = seq
        return self._queued_forks.pop(state_id, [])

    def drop(self, state_id: str) -> Sequence | None:
        """Forget a state (its salt and adapter too); the retained sequence, if it was one."""
        self._state_salts.pop(state_id, None)
        self._state_adapters.pop(state_id, None)
        return self._retained.pop(state_id, None)

    def queue_fork(self, request: Request) -> None:
        """Hold a fork until its trunk (`request.parent_id`) is retained."""
        assert request.parent_id is not None
        self._queued_forks[request.parent_id].append(request)

    def is_queued(self, request_id: str) -> bool:
        return any(r.request_id == request_id for q in self._queued_forks.values() for r in q)

    def unqueue(self, request_id: str) -> None:
        """Drop a queued fork."""
        for queued in self._queued_forks.values():
            queued[:] = [r for r in queued if r.request_id != request_id]

    def take_forks(self, trunk_id: str) -> list[Request]:
        """The forks queued for `trunk_id`, no longer queued."""
        return self._queued_forks.pop(trunk_id, [])

    def waited_trunks(self) -> list[str]:
        """Trunks that forks were queued for, sorted."""
        return sorted(self._queued_forks)

    def check_trunk(self, request: Request) -> None:
        """Refuse a trunk that forks already queued for it may not fork."""
        early_forks = self._queued_forks.get(request.request_id, [])
        if any(not self._adapters.may_fork(fork, request.adapter) for fork in early_forks):
            raise ContractError(
                f"trunk {request.request_id!r} runs under adapter {request.adapter!r}, which "
                "branches already sent for it may not fork: state never crosses adapters"
            )
        if any(fork.tenant_salt != request.tenant_salt for fork in early_forks):
            raise ContractError(
                f"trunk {request.request_id!r} has another tenant salt than branches already "
                "sent for it: state never crosses tenants"
            )

    def check_fork(self, request: Request) -> None:
        """Refuse a fork of a state of another tenant salt or an adapter it may not fork."""
        assert request.parent_id is not None
        parent_salt = self._state_salts.get(request.parent_id, request.tenant_salt)
        if parent_salt != request.tenant_salt:
            raise ContractError(
                f"request {request.request_id!r} forks {request.parent_id!r} of another "
                "tenant salt: state never crosses tenants"
            )
        parent_adapter = self._state_adapters.get(request.parent_id, request.adapter)
        if not self._adapters.may_fork(request, parent_adapter):
            raise ContractError(
                f"request {request.request_id!r} (adapter {request.adapter!r}) forks "
                f"{request.parent_id!r} (adapter {parent_adapter!r}): state never crosses "
                "adapters (only an activated adapter whose invocation follows a base "
                "trunk may fork it)"
            )
