import pytest

from kmesh.index.prefix_index import PrefixIndex
from kmesh.state.keys import BlockHash

K1, K2, K3 = BlockHash(b"1" * 32), BlockHash(b"2" * 32), BlockHash(b"3" * 32)


def test_match_returns_the_longest_indexed_run():
    index = PrefixIndex()
    index.insert(K1, [1, 2], block_id=7)
    index.insert(K2, [3, 4], block_id=8)
    assert index.match([K1, K2, K3], [[1, 2], [3, 4], [5, 6]]) == [7, 8]
    assert index.match([K2], [[3, 4]]) == [8]


def test_a_key_hit_with_other_tokens_is_a_miss():
    index = PrefixIndex()
    index.insert(K1, [1, 2], block_id=7)
    assert index.match([K1], [[1, 3]]) == []


def test_match_stops_at_the_first_gap():
    index = PrefixIndex()
    index.insert(K1, [1, 2], block_id=7)
    index.insert(K3, [5, 6], block_id=9)
    assert index.match([K1, K2, K3], [[1, 2], [3, 4], [5, 6]]) == [7]


def test_first_writer_keeps_the_key():
    index = PrefixIndex()
    assert index.insert(K1, [1, 2], block_id=7)
    assert not index.insert(K1, [1, 2], block_id=8)
    assert index.match([K1], [[1, 2]]) == [7]
    assert not index.is_indexed(8)


def test_removed_block_no_longer_matches():
    index = PrefixIndex()
    index.insert(K1, [1, 2], block_id=7)
    index.remove_block(7)
    index.remove_block(7)  # no-op the second time
    assert index.match([K1], [[1, 2]]) == []
    assert len(index) == 0


def test_a_block_cannot_hold_two_keys():
    index = PrefixIndex()
    index.insert(K1, [1, 2], block_id=7)
    with pytest.raises(ValueError):
        index.insert(K2, [3, 4], block_id=7)
