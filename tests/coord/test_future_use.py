import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.coord.future_use import EvictionOrder


def _order(retention: str = "future_use", **sizes: int) -> EvictionOrder[str]:
    order = EvictionOrder[str](retention)
    for ident, size in sizes.items():
        order.add(ident, size)
    return order


def _drain(order: EvictionOrder[str]) -> list[str]:
    gone = []
    while (victim := order.victim()) is not None:
        order.remove(victim)
        gone.append(victim)
    return gone


def test_ended_entries_go_first_then_undeclared_then_the_furthest_declared_use():
    order = _order(a=1, b=1, c=1, d=1, e=1)
    order.pin("a", next_use=3)
    order.pin("b", next_use=7)
    order.pin("c")  # needed now: goes last
    order.pin("e", next_use=5)
    order.unpin("e", 5)  # its family closed: no one comes back for it
    order.touch("d")
    assert _drain(order) == ["e", "d", "b", "a", "c"]


def test_a_new_declaration_replaces_the_date_and_unpinned_entries_ignore_it():
    order = _order(a=1, b=1, c=1)
    order.pin("a", next_use=1)
    order.pin("b", next_use=2)
    order.declare("a", 9, was=1)  # a was read; its next use is now the furthest
    order.declare("c", 100)  # not pinned: nothing declared
    assert _drain(order) == ["c", "a", "b"]


def test_an_entry_keeps_the_soonest_date_its_pins_hold_whatever_the_order_they_came_in():
    order = _order(a=1, b=1)
    order.pin("a", next_use=2)  # family f reads a at 2
    order.pin("b", next_use=5)
    order.pin("a", next_use=10)  # family g reads it later: a is still needed at 2
    assert order.victim() == "b"
    order.declare("a", 20, was=2)  # f read it, and reads it again at 20: g's 10 is soonest
    assert order.victim() == "a"
    order.unpin("a", 10)  # g closed: only f's 20 is left
    order.declare("b", 30, was=5)
    assert order.victim() == "b" and order.pinned == 2
    order.unpin("a", 20)
    assert order.pinned == 1 and order.victim() == "a"  # ended: goes first


def test_among_equal_dates_the_tail_of_a_chain_goes_before_its_head():
    order = _order(head=1, middle=1, tail=1, other=1)
    for ident in ("head", "middle", "tail", "other"):
        order.pin(ident, next_use=5 if ident != "other" else 1)
    for ident in ("head", "middle", "tail"):  # a chain is read head to tail
        order.touch(ident)
    assert _drain(order) == ["tail", "middle", "head", "other"]


def test_lru_never_evicts_a_pinned_entry_and_an_unpinned_one_comes_back_as_most_recent():
    order = _order("lru", a=1, b=2, c=4)
    order.pin("a")
    assert order.evictable == 6 and order.pinned == 1
    order.unpin("a")
    order.pin("b")
    assert order.evictable == 5
    assert _drain(order) == ["c", "a"] and len(order) == 1


def test_unknown_retention_and_a_stray_unpin_are_refused():
    with pytest.raises(ValueError, match="retention must be one of"):
        EvictionOrder[str]("fifo")
    with pytest.raises(ValueError, match="no pin"):
        _order(a=1).unpin("a")


@given(
    st.sampled_from(["future_use", "lru"]),
    st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "touch", "pin", "unpin", "declare"]),
            st.integers(0, 5),
            st.integers(0, 9),
        ),
        max_size=60,
    ),
)
def test_evictable_bytes_are_the_sizes_victim_can_give(retention, ops):
    order = EvictionOrder[int](retention)
    pins: dict[int, list[int]] = {}  # each pin's date
    for op, ident, when in ops:
        if op == "add" and ident not in order:
            order.add(ident, ident + 1)
            pins[ident] = []
        elif ident not in order:
            continue
        elif op == "remove":
            order.remove(ident)
            del pins[ident]
        elif op == "touch":
            order.touch(ident)
        elif op == "pin":
            order.pin(ident, when)
            pins[ident].append(when)
        elif op == "unpin" and pins[ident]:
            order.unpin(ident, pins[ident].pop())
        elif op == "declare" and pins[ident]:
            order.declare(ident, when, pins[ident][0])
            pins[ident][0] = when
    assert order.pinned == sum(1 for dates in pins.values() if dates)
    declared = [i for i, dates in pins.items() if dates]
    if retention == "future_use" and declared and not [i for i in pins if not pins[i]]:
        soonest = max(min(pins[i]) for i in declared)  # every entry is pinned: the furthest goes
        assert min(pins[order.victim()]) == soonest
    may_go = [i for i, dates in pins.items() if retention == "future_use" or not dates]
    assert order.evictable == sum(i + 1 for i in may_go)
    assert sorted(_drain(order)) == sorted(may_go)
