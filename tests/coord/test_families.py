import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.coord.families import EndedFamily, FamilyRegistry, RequestFamilies, StateStatus
from kmesh.errors import ContractError
from kmesh.state.request_meta import KMeshParams


def ready_family(num_branches=2):
    reg = FamilyRegistry()
    reg.declare("f", "trunk", num_branches)
    reg.mark_ready("trunk")
    return reg


def test_a_family_can_be_declared_before_its_trunk_exists():
    reg = FamilyRegistry()
    reg.declare("f", "trunk", 2)
    assert reg.status("trunk") is StateStatus.PENDING
    reg.add_state("trunk")  # the trunk request arrives later
    reg.check_fork("trunk", 2)


def test_trunk_is_released_when_its_last_declared_branch_ends():
    reg = ready_family(2)
    for branch in ("b0", "b1"):
        reg.check_fork("trunk", 1)
        reg.add_branch("trunk", branch)
    assert reg.end("b0") == []
    assert reg.end("b1") == ["trunk"]
    assert reg.status("trunk") is StateStatus.CLOSED


def test_release_cascades_up_a_tree():
    reg = ready_family(1)
    reg.add_branch("trunk", "node")
    reg.declare("g", "node", 2)
    reg.mark_ready("node")
    reg.add_branch("node", "leaf0")
    reg.add_branch("node", "leaf1")
    assert reg.end("leaf0") == []
    assert sorted(reg.end("leaf1")) == ["node", "trunk"]


def test_closing_a_family_releases_a_ready_trunk_now():
    reg = ready_family(3)
    reg.add_branch("trunk", "b0")
    assert reg.close("f") == ["trunk"]
    with pytest.raises(ContractError, match="closed"):
        reg.check_fork("trunk", 1)


def test_closing_before_the_trunk_is_ready_releases_it_when_ready():
    reg = FamilyRegistry()
    reg.declare("f", "trunk", 2)
    assert reg.close("f") == []
    assert reg.mark_ready("trunk") == ["trunk"]


@pytest.mark.parametrize(
    ("setup", "parent", "num", "message"),
    [
        (lambda reg: None, "nobody", 1, "unknown state 'nobody'"),
        (lambda reg: reg.end("trunk"), "trunk", 1, "closed"),
        (lambda reg: None, "trunk", 0, "at least 1 branch"),
        (lambda reg: None, "trunk", 3, "declared 2 branches"),
    ],
)
def test_bad_forks_are_refused(setup, parent, num, message):
    reg = ready_family(2)
    setup(reg)
    with pytest.raises(ContractError, match=message):
        reg.check_fork(parent, num)


def test_undeclared_pending_state_cannot_be_forked():
    reg = FamilyRegistry()
    reg.add_state("s")
    with pytest.raises(ContractError, match="not computed yet"):
        reg.check_fork("s", 1)


@pytest.mark.parametrize("count", [0, -2])
def test_a_family_needs_at_least_one_branch(count):
    with pytest.raises(ContractError, match="at least 1"):
        FamilyRegistry().declare("f", "t", count)


def test_ids_are_not_reused():
    reg = ready_family(1)
    with pytest.raises(ContractError, match="already declared"):
        reg.declare("f", "other", 1)
    with pytest.raises(ContractError, match="already the trunk"):
        reg.declare("g", "trunk", 1)
    reg.add_branch("trunk", "b")
    with pytest.raises(ContractError, match="already in use"):
        reg.add_branch("trunk", "b")


@given(st.integers(1, 6), st.permutations(range(6)))
def test_trunk_released_exactly_once_after_all_branches_in_any_order(n, order):
    reg = ready_family(n)
    for i in range(n):
        reg.add_branch("trunk", f"b{i}")
    released = []
    for i in [i for i in order if i < n]:
        assert reg.status("trunk") is StateStatus.READY
        released += reg.end(f"b{i}")
    assert released == ["trunk"]


def test_closed_states_are_forgotten_oldest_first_past_the_limit():
    reg = FamilyRegistry(max_closed=4)
    for i in range(10):  # families opened and ended, one branch each
        reg.declare(f"f{i}", f"t{i}", 1)
        reg.mark_ready(f"t{i}")
        reg.add_branch(f"t{i}", f"b{i}")
        reg.end(f"b{i}")
    assert len(reg) == 4
    assert [reg.status(f"b{i}") for i in (8, 9)] == [StateStatus.CLOSED] * 2
    assert reg.status("t0") is None and reg.status("b0") is None
    with pytest.raises(ContractError, match="never declared"):
        reg.family("f0")  # forgotten with its trunk
    with pytest.raises(ContractError, match="unknown state"):
        reg.check_fork("t0", 1)
    reg.declare("f0", "t0", 1)  # a forgotten id may be used again


def test_a_live_branch_ends_after_its_family_was_forgotten():
    reg = FamilyRegistry(max_closed=1)
    reg.declare("f", "trunk", 2)
    reg.mark_ready("trunk")
    reg.add_branch("trunk", "b0")
    reg.close("f")
    reg.end("trunk")  # released
    reg.end("other")  # an unknown id: nothing
    reg.add_state("plain")
    reg.end("plain")  # pushes the trunk, and its family, out
    with pytest.raises(ContractError, match="never declared"):
        reg.family("f")
    assert reg.end("b0") == []
    assert reg.status("b0") is StateStatus.CLOSED


def _member(family: str, **kwargs) -> KMeshParams:
    return KMeshParams(family=family, **kwargs)


def test_a_request_family_ends_when_its_declared_branches_have_finished():
    families = RequestFamilies(max_open=10)
    families.pinned("f", "kmesh-approx:x#tenant=a")
    families.pinned("f", "#tenant=a")
    assert families.end_member(_member("f", branches=2), "#tenant=a") == []
    # A member under another salt of the same tenant counts toward the same family.
    [ended] = families.end_member(_member("f", branches=2), "kmesh-approx:y#tenant=a")
    assert ended == EndedFamily("f", frozenset({"kmesh-approx:x#tenant=a", "#tenant=a"}))


def test_a_member_that_closes_its_request_family_ends_it_at_once():
    families = RequestFamilies(max_open=10)
    assert families.end_member(_member("f", branches=4, close=True), None) == [
        EndedFamily("f", frozenset())
    ]
    assert families.end_member(KMeshParams(), None) == []  # not a family member


def test_another_tenants_family_of_the_same_name_is_another_family():
    families = RequestFamilies(max_open=2)
    families.pinned("council", "#tenant=a")
    assert families.end_member(_member("council", branches=3), "#tenant=a") == []
    # B's members neither count toward A's family nor close it.
    assert families.end_member(_member("council", branches=3), "#tenant=b") == []
    assert families.end_member(_member("council", close=True), "#tenant=b") == [
        EndedFamily("council", frozenset())
    ]
    # B's open families do not crowd A's out: each tenant has its own limit.
    for family in ("f0", "f1", "f2"):
        families.end_member(_member(family, branches=4), "#tenant=b")
    assert families.end_member(_member("council", branches=3), "#tenant=a") == []
    [ended] = families.end_member(_member("council", branches=3), "#tenant=a")
    assert ended == EndedFamily("council", frozenset({"#tenant=a"}))


def test_past_the_open_limit_the_oldest_request_family_ends():
    families = RequestFamilies(max_open=2)
    for family in ("f0", "f1"):
        assert families.end_member(_member(family, branches=4), None) == []
    assert families.end_member(_member("f2", branches=4), None) == [EndedFamily("f0", frozenset())]
