"""Per-request reuse's stored segments (kmesh/recovery/segment_store.py) with shared state that
counts what it is asked: once per segment and step, a miss asked again the next step."""

import torch

from kmesh.compute.tiny import tiny_executor
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.requests import RequestRecovery
from tests.recovery.test_requests import NONE, ExactPages, job, no_write, prompt, span


class CountingSegments:
    """Shared first readers' segments in a dict, counting each `get` by tokens."""

    def __init__(self) -> None:
        self.held: dict[tuple[str | None, tuple[int, ...]], SegmentKV] = {}
        self.asked: dict[tuple[int, ...], int] = {}

    def get(self, tenant, tokens):
        self.asked[tuple(tokens)] = self.asked.get(tuple(tokens), 0) + 1
        return self.held.get((tenant, tuple(tokens)))

    def put(self, tenant, tokens, segment) -> None:
        """Published by another engine: this test's engine never publishes."""


def _recovery(shared: CountingSegments) -> RequestRecovery:
    executor, fingerprint = tiny_executor()
    recovery = RequestRecovery(executor, fingerprint)
    recovery.segments.shared = shared
    return recovery


def test_a_step_asks_shared_state_once_per_segment_even_for_one_it_lacks():
    shared = CountingSegments()
    recovery = _recovery(shared)
    ids, spans = prompt("ab", ask=[])  # "b" crosses past the claim: its end is asked for too
    work = job(ids, spans, NONE)
    pages = ExactPages(recovery.executor, ids)
    recovery.run([work, job(ids, spans, NONE, request_id="s")], pages, no_write)
    b = span(spans, "b")
    assert shared.asked[tuple(ids[b.start : b.end])] == 1
    assert set(shared.asked.values()) == {1}


def test_a_segment_another_engine_publishes_after_a_miss_is_found_from_the_next_step_on():
    shared = CountingSegments()
    segments = _recovery(shared).segments
    tokens = (1, 2, 3)
    assert segments.get("t", tokens) is None
    shared.held[("t", tokens)] = SegmentKV(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    assert segments.get("t", tokens) is None  # this step's miss is remembered
    segments.begin_step()
    assert segments.get("t", tokens) is not None
    assert shared.asked[tokens] == 2
