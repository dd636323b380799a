import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.kv.block_pool import BlockPool


def test_allocate_takes_the_least_recently_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.release([a[2], a[0], a[3], a[1]])
    assert pool.allocate(4) == [a[2], a[0], a[3], a[1]]


def test_acquiring_a_free_block_takes_it_off_the_free_queue():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.release([block])
    assert pool.num_free == 2
    pool.acquire(block)
    assert pool.num_free == 1
    assert pool.allocate(1) != [block]


def test_shared_block_is_free_only_after_its_last_user():
    pool = BlockPool(1)
    [block] = pool.allocate(1)
    pool.acquire(block)
    pool.release([block])
    assert pool.num_free == 0
    pool.release([block])
    assert pool.num_free == 1


def test_allocating_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)


@given(st.lists(st.tuples(st.sampled_from(["alloc", "acquire", "release"]), st.integers(0, 7))))
def test_every_block_is_either_used_or_free(ops):
    pool = BlockPool(8)
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc" and pool.num_free:
            held += pool.allocate(1 + arg % pool.num_free)
        elif op == "acquire":
            pool.acquire(arg)
            held.append(arg)
        elif op == "release" and held:
            pool.release([held.pop(arg % len(held))])
    in_use = {b for b in range(8) if pool.ref_count(b) > 0}
    assert pool.num_free + len(in_use) == 8
    assert all(pool.ref_count(b) == held.count(b) for b in range(8))
