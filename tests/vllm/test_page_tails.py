"""The index of kept page tails (kmesh/vllm/page_tails.py): no tensors, no vLLM."""

from kmesh.state.keys import BlockHash
from kmesh.vllm.page_tails import PageTails

ROW = 10  # bytes per row
A, B = BlockHash(b"a" * 32), BlockHash(b"b" * 32)
PREFIX = list(range(100, 108))  # the tokens before every tail here: two 4-token pages


def test_a_tail_gives_the_rows_a_later_request_shares_up_to_where_it_stops():
    tails = PageTails(ROW)
    tail_id = tails.file(A, 8, [*PREFIX, 1, 2, 3])
    assert tail_id is not None
    hit = tails.find(A, [*PREFIX, 1, 2, 3, 4], 8, 11)
    assert hit is not None and (hit.tail_id, hit.start, hit.end) == (tail_id, 8, 11)
    diverging = tails.find(A, [*PREFIX, 1, 9, 3], 8, 11)
    assert diverging is not None and diverging.end == 9  # only the row before the first change
    capped = tails.find(A, [*PREFIX, 1, 2, 3], 8, 10)  # the request's last token stays vLLM's
    assert capped is not None and capped.end == 10


def test_a_tail_serves_only_its_anchor_and_its_page_start():
    tails = PageTails(ROW)
    tails.file(A, 8, [*PREFIX, 1, 2])
    assert tails.find(B, [*PREFIX, 1, 2, 3], 8, 11) is None  # another tenant's or adapter's chain
    assert tails.find(A, [*PREFIX, 1, 2, 3], 4, 11) is None


def test_a_hit_compares_every_token_before_the_tail_not_only_the_anchor():
    tails = PageTails(ROW)
    tails.file(A, 8, [*PREFIX, 1, 2])
    other_prefix = [*PREFIX[:-1], 999, 1, 2, 3]  # as if its anchor collided
    assert tails.find(A, other_prefix, 8, 11) is None


def test_a_request_takes_the_tail_sharing_the_most_rows():
    tails = PageTails(ROW)
    short = tails.file(A, 8, [*PREFIX, 1, 5])
    long = tails.file(A, 8, [*PREFIX, 1, 2, 3])
    hit = tails.find(A, [*PREFIX, 1, 2, 3, 4], 8, 11)
    assert short is not None and hit is not None and hit.tail_id == long


def test_a_tail_extending_a_kept_one_replaces_it_and_a_covered_one_is_not_filed():
    tails = PageTails(ROW)
    first = tails.file(A, 8, [*PREFIX, 1])
    longer = tails.file(A, 8, [*PREFIX, 1, 2, 3])
    assert first is not None and longer is not None
    assert tails.take_dropped() == [first]
    assert tails.file(A, 8, [*PREFIX, 1, 2]) is None  # the kept one holds these rows
    assert tails.held_bytes == 3 * ROW


def test_clearing_drops_every_tail():
    tails = PageTails(ROW)
    kept = [tails.file(A, 8, [*PREFIX, 1]), tails.file(B, 8, [*PREFIX, 2])]
    tails.clear()
    assert sorted(tails.take_dropped()) == kept and tails.held_bytes == 0
    assert tails.find(A, [*PREFIX, 1, 2], 8, 10) is None


def test_past_its_budget_the_least_recently_used_tail_is_dropped():
    tails = PageTails(ROW, budget_bytes=5 * ROW)
    old = tails.file(A, 8, [*PREFIX, 1, 2])
    used = tails.file(B, 8, [*PREFIX, 1, 2])
    assert tails.find(A, [*PREFIX, 1, 2, 3], 8, 11) is not None  # `old` is now the most recent
    assert tails.file(A, 8, [*PREFIX, 7, 7]) is not None
    assert tails.take_dropped() == [used]
    assert old is not None and tails.held_bytes == 4 * ROW
    assert tails.file(A, 4, PREFIX[:4] + [5] * 6) is None  # six rows never fit five
