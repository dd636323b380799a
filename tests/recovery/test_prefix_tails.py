"""Kept prompt tails past an engine's last whole page (kmesh/recovery/prefix_tails.py), with
stand-in rows: which boundaries are kept, and when a later request may take one."""

import torch

from kmesh.recovery.jobs import RecoveryJob
from kmesh.recovery.prefix_tails import PrefixTails, TailPages, boundaries
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.segments import Role, Span

PAGE = 4
SPEC = RecoverySpec(policy="none")


def job(parts, start, tenant="kmesh-approx:t", end=None) -> RecoveryJob:
    """A job over segments given as (role, tokens), claiming [start, end or the last token)."""
    ids: list[int] = []
    spans = []
    for i, (role, tokens) in enumerate(parts):
        spans.append(Span(len(ids), len(ids) + len(tokens), Role(role), f"s{i}"))
        ids.extend(tokens)
    stop = len(ids) - 1 if end is None else end
    return RecoveryJob("r", ids, [0, 1, 2, 3, 4], start, stop, tenant, spans, SPEC, None)


SYSTEM = ("shared", [1, 2, 3, 4, 5, 6])  # the trunk ends at 6, inside page [4, 8)


def rows(work: RecoveryJob) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows for the claim [start, end): row i holds position start + i."""
    n = work.end - work.start
    k = torch.arange(work.start, work.end, dtype=torch.float32).view(1, n, 1, 1).expand(2, n, 1, 3)
    return k.clone(), -k.clone()


def test_the_trunks_end_and_the_last_segments_start_are_the_boundaries():
    work = job([SYSTEM, ("private", [7, 8, 9]), ("shared", [10, 11]), ("instruction", [12])], 0)
    assert boundaries(work) == [6, 11]
    assert boundaries(job([("private", [7, 8]), ("instruction", [9, 9])], 0)) == [2]


def test_a_chats_last_message_before_its_generation_prompt_is_a_boundary_too():
    """A round's next prompt drops the ask (the last message) and continues before it; a tool
    loop's keeps it and continues before the generation prompt: both are boundaries."""
    ask, generation = ("private", [13]), ("instruction", [2])
    chat = job([SYSTEM, ("private", [7, 8]), ("shared", [10, 11]), ask, generation], 0)
    assert boundaries(chat) == [6, 10, 11]
    after_output = job([SYSTEM, ("private", [7]), ("shared", [10, 11]), ("instruction", [12])], 0)
    assert boundaries(after_output) == [6, 9]  # only the caller's own message is a closing


def test_a_sibling_whose_prefix_continues_the_kept_tail_takes_its_rows():
    tails = PrefixTails("model", PAGE)
    first = job([SYSTEM, ("private", [7, 8, 9]), ("instruction", [12, 13])], 0)
    kept = tails.keep(first, *rows(first))
    assert [(len(prefix), nbytes) for prefix, nbytes in kept] == [
        (6, 96),
        (9, 48),
    ]  # k and v: 2 layers x rows x 3 floats
    sibling = job([SYSTEM, ("private", [20, 21]), ("instruction", [12])], 4)  # page 0 hit
    found = tails.find(sibling)
    assert found is not None
    end, (k, v) = found
    assert end == 6 and torch.equal(k[0, :, 0, 0], torch.tensor([4.0, 5.0]))  # rows 4 and 5
    assert torch.equal(v, -k)


def test_a_tail_is_taken_only_by_the_same_tokens_in_the_same_tenant_inside_the_claim():
    tails = PrefixTails("model", PAGE)
    first = job([SYSTEM, ("private", [7, 8, 9]), ("instruction", [12, 13])], 0)
    tails.keep(first, *rows(first))
    other_tenant = job([SYSTEM, ("instruction", [7, 8])], 4, tenant="kmesh-approx:u")
    assert tails.find(other_tenant) is None
    other_token = job([("shared", [1, 2, 3, 4, 5, 0]), ("instruction", [7, 8])], 4)
    assert tails.find(other_token) is None
    short_claim = job([SYSTEM, ("instruction", [7, 8])], 4, end=6)  # the tail would fill it all
    assert tails.find(short_claim) is None
    off_page = job([SYSTEM, ("instruction", [7, 8])], 3)  # a claim starting inside a page
    assert tails.find(off_page) is None
    tails.discard("kmesh-approx:t", first.token_ids[:6])
    assert tails.find(job([SYSTEM, ("instruction", [7, 8])], 4)) is None


class _Pages:
    """Stand-in pages: row p of any request holds position p (k) and -p (v); rows a job has
    not written yet hold garbage (1e9)."""

    def __init__(self, written: int) -> None:
        self.written = written

    def read(self, block_ids, positions):
        k = positions.float().masked_fill(positions >= self.written, 1e9)
        k = k.view(1, -1, 1, 1).expand(2, -1, 1, 3).clone()
        return k, -k


def test_a_job_continued_by_a_tail_reads_its_prefix_from_the_pages_then_the_tail():
    work = job([SYSTEM, ("private", [7, 8, 9]), ("instruction", [12, 13])], 4)
    tail = rows(job([SYSTEM, ("private", [7, 8, 9])], 4, end=6))  # rows 4, 5
    read = TailPages(_Pages(written=4))
    read.add(work, (tail[0] + 0.5, tail[1] - 0.5))  # tail rows told apart from page rows
    for positions in (torch.arange(6), torch.tensor([0, 2, 5])):
        k, v = read.read(work.block_ids, positions)
        expected = positions.float() + (positions >= 4) * 0.5
        assert torch.equal(k[1, :, 0, 2], expected)
        assert torch.equal(v, -k)
    k, _ = read.read(work.block_ids, torch.arange(3))  # no tail row asked for
    assert torch.equal(k[0, :, 0, 0], torch.tensor([0.0, 1.0, 2.0]))
