"""Family lifecycles: when the state a family shares may be let go. Pure bookkeeping, no I/O.

`FamilyRegistry` (the reference engine): a trunk state and the branches declared to fork it (trees
are families of families), over state ids. The engine asks it whether a fork is allowed, tells it
when states become forkable and when branches end, and is told which retained states to release.
Closed states are remembered (a fork of one is refused as closed) up to `max_closed`, the oldest
forgotten first, a trunk with its family: a forgotten id is unknown (a fork of it is refused as
unknown) and may be used again.

`RequestFamilies` (both engines' store pins): families declared by requests' kmesh params, with
no state ids, each its tenant's: the family ends when a member closes it or its declared branches
have finished, and says whose store pins to close."""

import enum
from dataclasses import dataclass, field

from kmesh.coord.retention import Retention
from kmesh.errors import ContractError
from kmesh.state.request_meta import KMeshParams
from kmesh.state.tenants import tenant_of_salt

# Closed states remembered at most (a few hundred bytes each).
MAX_CLOSED_STATES = 10_000


class StateStatus(enum.Enum):
    PENDING = "pending"  # declared (as a trunk) or requested, not computed yet
    READY = "ready"  # computed and retained: forkable
    CLOSED = "closed"  # released (or ended): cannot be forked


@dataclass(slots=True)
class Family:
    family_id: str
    trunk_id: str
    num_branches: int
    branch_ids: list[str] = field(default_factory=list)
    num_ended: int = 0
    closed: bool = False


class FamilyRegistry:
    """States by id, and which family (if any) each state is a trunk or a branch of.

    Invariants: a state is the trunk of at most one family and a branch of at most one; a family
    never has more branches than it declared; a closed state is never READY again.
    """

    def __init__(self, max_closed: int = MAX_CLOSED_STATES) -> None:
        self._status: dict[str, StateStatus] = {}
        self._families: dict[str, Family] = {}
        self._family_of_trunk: dict[str, str] = {}
        self._family_of_branch: dict[str, str] = {}
        self._closed: Retention[str] = Retention(max_closed)

    def __len__(self) -> int:
        """States remembered (pending, ready or closed)."""
        return len(self._status)

    def status(self, state_id: str) -> StateStatus | None:
        return self._status.get(state_id)

    def family(self, family_id: str) -> Family:
        if family_id not in self._families:
            raise ContractError(f"family {family_id!r} was never declared")
        return self._families[family_id]

    def trunk_family(self, state_id: str) -> Family | None:
        family_id = self._family_of_trunk.get(state_id)
        return None if family_id is None else self._families[family_id]

    def declare(self, family_id: str, trunk_id: str, num_branches: int) -> Family:
        """Declare a family up front; its trunk may not be computed yet."""
        if family_id in self._families:
            raise ContractError(f"family {family_id!r} is already declared")
        if num_branches < 1:
            raise ContractError(
                f"family {family_id!r} declares {num_branches} branches: declare at least 1"
            )
        if self._status.get(trunk_id) is StateStatus.CLOSED:
            raise ContractError(f"state {trunk_id!r} is closed: it cannot be a trunk again")
        if trunk_id in self._family_of_trunk:
            raise ContractError(
                f"state {trunk_id!r} is already the trunk of family "
                f"{self._family_of_trunk[trunk_id]!r}"
            )
        self._status.setdefault(trunk_id, StateStatus.PENDING)
        family = Family(family_id, trunk_id, num_branches)
        self._families[family_id] = family
        self._family_of_trunk[trunk_id] = family_id
        return family

    def add_state(self, state_id: str) -> None:
        """Register a retained state about to be computed (a declared trunk already is)."""
        status = self._status.get(state_id)
        if status is StateStatus.PENDING and state_id in self._family_of_trunk:
            return
        if status is not None:
            raise ContractError(f"state id {state_id!r} is already in use")
        self._status[state_id] = StateStatus.PENDING

    def mark_ready(self, state_id: str) -> list[str]:
        """The state is computed and retained. Returns [state_id] when it must be released at
        once (its family was closed before it was ready; start queued forks first)."""
        self._status[state_id] = StateStatus.READY
        family = self.trunk_family(state_id)
        return [state_id] if family is not None and family.closed else []

    def check_fork(self, parent_id: str, num: int) -> Family | None:
        """Refuse a fork of `num` branches from an unknown or closed state, or past what its
        family declared. Returns the parent's family, if it has one."""
        if num < 1:
            raise ContractError(f"a fork needs at least 1 branch, got {num}")
        status = self._status.get(parent_id)
        if status is None:
            raise ContractError(f"cannot fork unknown state {parent_id!r}")
        if status is StateStatus.CLOSED:
            raise ContractError(f"cannot fork state {parent_id!r}: it is closed")
        family = self.trunk_family(parent_id)
        if family is not None:
            if family.closed:
                raise ContractError(f"cannot fork family {family.family_id!r}: it is closed")
            if len(family.branch_ids) + num > family.num_branches:
                raise ContractError(
                    f"family {family.family_id!r} declared {family.num_branches} branches and "
                    f"already has {len(family.branch_ids)}: {num} more is too many"
                )
        elif status is StateStatus.PENDING:
            raise ContractError(
                f"state {parent_id!r} is not computed yet; declare a family for it to queue "
                "branches before it is ready"
            )
        return family

    def add_branch(self, parent_id: str, branch_id: str) -> None:
        """Record a branch forked from `parent_id` (after check_fork)."""
        self.add_state(branch_id)
        family = self.trunk_family(parent_id)
        if family is not None:
            family.branch_ids.append(branch_id)
            self._family_of_branch[branch_id] = family.family_id

    def end(self, state_id: str) -> list[str]:
        """A state is done (finished, or released). Returns the retained trunks to release now:
        those whose declared branches have all ended, cascading up a tree."""
        to_release: list[str] = []
        pending = [state_id]
        while pending:
            current = pending.pop()
            if self._status.get(current, StateStatus.CLOSED) is StateStatus.CLOSED:
                continue  # unknown (a plain request) or already ended
            self._status[current] = StateStatus.CLOSED
            for old in self._closed.add(current):
                self._forget(old)
            family = self._families.get(self._family_of_branch.get(current, ""))
            if family is None:  # not a branch, or its family was forgotten
                continue
            family.num_ended += 1
            if family.num_ended == family.num_branches:
                family.closed = True
                if self._status[family.trunk_id] is StateStatus.READY:
                    to_release.append(family.trunk_id)
                    pending.append(family.trunk_id)
        return to_release

    def close(self, family_id: str) -> list[str]:
        """Close a family early: no more forks. Returns [trunk id] when the trunk is retained and
        must be released now (live branches keep what they share by reference); a trunk not
        computed yet is released as soon as it is (see mark_ready)."""
        family = self.family(family_id)
        family.closed = True
        if self._status.get(family.trunk_id) is StateStatus.READY:
            return [family.trunk_id]
        return []

    def _forget(self, state_id: str) -> None:
        """Forget a closed state, and the family it is the trunk of (a closed trunk takes no
        more forks; a branch still live then ends without it)."""
        del self._status[state_id]
        self._family_of_branch.pop(state_id, None)
        family_id = self._family_of_trunk.pop(state_id, None)
        if family_id is not None:
            del self._families[family_id]


@dataclass(frozen=True, slots=True)
class EndedFamily:
    """A request-declared family that ended: its name and the salts under which its members
    pinned store state (to close)."""

    family_id: str
    salts: frozenset[str | None]


class RequestFamilies:
    """Families declared by the requests themselves (kmesh params `family`, `branches`,
    `close`), as a serving engine sees them: no states, only members that finish, each under
    its cache salt. A family is its tenant's (state/tenants.py::tenant_of_salt: what follows the
    salt's `#tenant=`, None without): the same name under two tenants is two families, neither of
    which the other's members count toward, close or crowd out; within a tenant, members under
    different salts (an exact and an approximate one) are one family.

    A family is open from its first pin or member until it is closed (a member with `close`),
    its declared `branches` members have all finished, or it is the oldest of more than
    `max_open` families of its tenant with a finished member (abandoned families are let go
    oldest first).
    Invariant: every family counted is open; an ended family is forgotten (a later member opens
    it again).
    """

    def __init__(self, max_open: int) -> None:
        self.max_open = max_open
        self._finished: dict[tuple[str | None, str], int] = {}  # finished members per family
        self._open: dict[str | None, Retention[str]] = {}  # per tenant
        self._salts: dict[tuple[str | None, str], set[str | None]] = {}

    def pinned(self, family_id: str, salt: str | None) -> None:
        """A member pinned state for the family under `salt` (its trunk, its transcript)."""
        self._salts.setdefault((tenant_of_salt(salt), family_id), set()).add(salt)

    def end_member(self, params: KMeshParams, salt: str | None) -> list[EndedFamily]:
        """A request under `salt` finished; returns the families that ended with it."""
        family = params.family
        if family is None:
            return []
        tenant = tenant_of_salt(salt)
        key = (tenant, family)
        self._finished[key] = self._finished.get(key, 0) + 1
        open_ = self._open.setdefault(tenant, Retention(self.max_open))
        if params.close or (params.branches is not None and self._finished[key] >= params.branches):
            ended = [family]
        else:
            ended = open_.add(family)  # the tenant's oldest open ones, past the limit
        result = []
        for done in ended:
            del self._finished[(tenant, done)]
            open_.discard(done)
            result.append(EndedFamily(done, frozenset(self._salts.pop((tenant, done), set()))))
        if not len(open_):
            del self._open[tenant]
        return result
