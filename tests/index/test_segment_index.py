import pytest

from kmesh.index.segment_index import AUTHOR, FIRST_READER, SegmentIndex
from kmesh.state.keys import KeyNamespace

MODEL = KeyNamespace("model-a")


def test_a_segment_is_found_by_content_and_context():
    index: SegmentIndex[str] = SegmentIndex(MODEL)
    index.put([5, 6, 7], "author", 0, "kv-author")
    index.put([5, 6, 7], "round-0-common", 0, "kv-common")
    assert index.get([5, 6, 7], "author") == "kv-author"
    assert index.get([5, 6, 7], "round-0-common") == "kv-common"
    assert index.get([5, 6, 7], "elsewhere") is None
    assert index.get([5, 6], "author") is None
    assert len(index) == 2


def test_namespaces_never_share_segments():
    ours: SegmentIndex[str] = SegmentIndex(KeyNamespace("model-a", tenant_salt="t1"))
    theirs: SegmentIndex[str] = SegmentIndex(KeyNamespace("model-a", tenant_salt="t2"))
    ours.put([1, 2], "author", 0, "secret")
    assert theirs.get([1, 2], "author") is None
    # Same tokens and context under another namespace hash to a different key.
    theirs.put([1, 2], "author", 0, "theirs")
    assert ours.get([1, 2], "author") == "secret"


def test_a_hit_compares_tokens(monkeypatch):
    index: SegmentIndex[str] = SegmentIndex(MODEL)
    monkeypatch.setattr("kmesh.index.segment_index.segment_key", lambda *_: b"same-digest")
    index.put([1, 2, 3], "author", 0, "first")
    assert index.get([9, 9, 9], "author") is None  # a colliding key never serves other tokens


def test_finished_rounds_are_dropped_together():
    index: SegmentIndex[int] = SegmentIndex(MODEL)
    for r in range(3):
        index.put([r + 10], "author", r, r)
    assert index.drop_rounds_before(2) == 2
    assert index.get([12], "author") == 2 and index.get([10], "author") is None


def test_empty_segments_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        SegmentIndex(MODEL).put([], "author", 0, "x")


def test_an_entry_is_found_inside_a_longer_segment_longest_first():
    index: SegmentIndex[str] = SegmentIndex(MODEL)
    index.put([5, 6, 7, 8], AUTHOR, 0, "short")
    index.put([5, 6, 7, 8, 9, 10], AUTHOR, 0, "long")
    index.put([1, 2, 3, 4], FIRST_READER, 0, "other context")
    header, closing = [1, 2, 3, 4], [0, 0]
    found = index.find_within([*header, 5, 6, 7, 8, 9, 10, *closing], AUTHOR)
    assert found is not None
    offset, entry = found
    assert (offset, entry.value, entry.token_ids) == (4, "long", (5, 6, 7, 8, 9, 10))
    assert index.find_within([5, 6, 7, 9, 10], AUTHOR) is None  # only whole entries match
    assert index.find_within([1, 2, 3, 4], AUTHOR) is None  # another context's entry


def test_a_discarded_or_dropped_entry_is_no_longer_found_inside_others():
    index: SegmentIndex[str] = SegmentIndex(MODEL)
    index.put([5, 6, 7, 8], AUTHOR, 0, "a")
    index.put([5, 6, 7, 8, 9], AUTHOR, 1, "b")
    assert index.discard([5, 6, 7, 8, 9], AUTHOR)
    found = index.find_within([0, 5, 6, 7, 8, 9], AUTHOR)
    assert found is not None and found[1].value == "a"
    assert index.drop_rounds_before(1) == 1
    assert index.find_within([0, 5, 6, 7, 8, 9], AUTHOR) is None
