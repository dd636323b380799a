import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.coord.retention import Retention


def test_the_oldest_ids_are_retired_first():
    kept = Retention[str](2)
    assert kept.add("a") == [] and kept.add("b") == []
    assert kept.add("a") == []  # a repeat is the newest again
    assert kept.add("c") == ["b"]
    assert "a" in kept and "c" in kept and len(kept) == 2


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        Retention[int](0)


@given(st.integers(1, 5), st.lists(st.integers(0, 9), max_size=40))
def test_retention_keeps_the_last_distinct_arrivals(limit, ids):
    kept, retired = Retention[int](limit), []
    for i in ids:
        retired += kept.add(i)
    last = list(dict.fromkeys(reversed(ids)))[:limit]
    assert len(kept) == len(last) and all(i in kept for i in last)
    assert set(retired) | set(last) == set(ids)
