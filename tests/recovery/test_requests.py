"""Recovery of requests (kmesh/recovery/requests.py) on a tiny random model, with the
request's exact prefix served from stand-in pages: per-request reuse of stored segment KV,
collective rounds, the gate, tenants."""

from dataclasses import replace

import pytest
import torch

from kmesh.compute.executor import SequenceInput
from kmesh.compute.rope import rerotate_keys
from kmesh.compute.tiny import tiny_executor
from kmesh.recovery.jobs import RecoveredRows, RecoveryJob
from kmesh.recovery.requests import RequestRecovery, _chunks
from kmesh.state.recovery_meta import RecoverySpec, RoundSpec
from kmesh.state.segments import Role, Span

SALT = "kmesh-approx:test"
BLOCK = 4
SYSTEM = list(range(10, 15))
A = list(range(20, 28))
B = list(range(40, 48))
ASK = [60, 61, 62]
PRIVATE = {"x": [70, 71, 72], "y": [80, 81, 82, 83, 84]}


def prompt(order: str, private: str = "x", ask=ASK) -> tuple[list[int], list[Span]]:
    parts = [("system", "shared", SYSTEM), (private, "private", PRIVATE[private])]
    parts += [(name, "shared", {"a": A, "b": B}[name]) for name in order]
    parts.append(("ask", "instruction", ask))
    ids: list[int] = []
    spans = []
    for name, role, tokens in parts:
        spans.append(Span(len(ids), len(ids) + len(tokens), Role(role), name))
        ids.extend(tokens)
    return ids, spans


def span(spans: list[Span], name: str) -> Span:
    return next(s for s in spans if s.segment_id == name)


class ExactPages:
    """Stand-in for vLLM's pages: the exact KV of the request's prompt, by position."""

    def __init__(self, executor, ids: list[int]) -> None:
        out = executor.forward([SequenceInput(torch.tensor(ids), torch.arange(len(ids)))])[0]
        self.k, self.v = torch.stack(out.k), torch.stack(out.v)
        self.reads: list[int] = []

    def read(self, block_ids, positions):
        self.reads.append(len(positions))
        return self.k[:, positions], self.v[:, positions]


@pytest.fixture(scope="module")
def model():
    return tiny_executor()


def job(ids, spans, spec, start=BLOCK, request_id="r", tenant=SALT, family=None, first_block=0):
    end = (len(ids) - 1) // BLOCK * BLOCK
    blocks = list(range(first_block, first_block + -(-len(ids) // BLOCK)))
    return RecoveryJob(request_id, ids, blocks, start, end, tenant, spans, spec, family)


def run(recovery, executor, ids, spans, spec, **kw):
    work = job(ids, spans, spec, **kw)
    pages = ExactPages(executor, ids)
    return recovered(recovery, [work], pages)[work.request_id], pages, work


NONE = RecoverySpec(policy="none", gate=None)


def no_write(job, outcome) -> None:
    """The engine's writer, where a test reads no outcome."""


def recovered(recovery, jobs, pages, write=no_write) -> dict[str, RecoveredRows]:
    """`recovery.run`'s outcomes with their rows, as the engine's writer is handed them (run
    returns them without)."""
    written: dict[str, RecoveredRows] = {}

    def keep(work, outcome) -> None:
        written[work.request_id] = outcome
        write(work, outcome)

    reported = recovery.run(jobs, pages, keep)
    assert all(out.k is None and out.v is None for out in reported.values())
    return {rid: replace(written[rid], transcript=out.transcript) for rid, out in reported.items()}


def test_the_first_reader_computes_its_region_exactly_and_stores_its_shared_segments(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    ids, spans = prompt("ab")
    outcome, pages, work = run(recovery, executor, ids, spans, NONE)
    assert outcome.report.reused_tokens == 0
    assert outcome.report.computed_tokens == work.end - work.start
    assert pages.reads == [work.start]  # the exact prefix comes from the pages, not recomputed
    rows = slice(work.start, work.end)
    torch.testing.assert_close(outcome.k, pages.k[:, rows], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outcome.v, pages.v[:, rows], atol=1e-5, rtol=1e-4)


def test_a_later_reader_reuses_stored_segments_rerotated_to_its_positions(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    first_ids, first_spans = prompt("ab")
    _, first_pages, _ = run(recovery, executor, first_ids, first_spans, NONE)
    ids, spans = prompt("ba", private="y")
    outcome, _, work = run(recovery, executor, ids, spans, NONE, request_id="r2")
    reused = len(A) + len(B)
    assert outcome.report.reused_tokens == reused
    assert outcome.report.computed_tokens == (work.end - work.start) - reused
    # a's keys: computed at its first position, turned to its new one (the exact RoPE move).
    a_first, a_now = span(first_spans, "a"), span(spans, "a")
    moved = rerotate_keys(
        first_pages.k[:, a_first.start : a_first.end],
        torch.arange(a_first.start, a_first.end),
        torch.arange(a_now.start, a_now.end),
        executor.config,
    )
    rows = slice(a_now.start - work.start, a_now.end - work.start)
    torch.testing.assert_close(outcome.k[:, rows], moved, atol=1e-5, rtol=1e-4)


def test_a_segment_crossing_past_the_claim_is_computed_whole_by_its_first_reader(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    ids, spans = prompt(
        "ab", private="y", ask=[60]
    )  # 27 tokens: b is [18, 26), the claim ends at 24
    outcome, pages, work = run(recovery, executor, ids, spans, NONE)
    assert work.end == 24 and span(spans, "b").end == 26
    assert outcome.report.computed_tokens == 26 - work.start  # b's last 2 tokens too
    assert outcome.k.shape[1] == work.end - work.start  # only the claimed rows are written
    torch.testing.assert_close(outcome.k, pages.k[:, work.start : work.end], atol=1e-5, rtol=1e-4)
    later, _, _ = run(recovery, executor, *prompt("ba"), NONE, request_id="r2")
    assert later.report.reused_tokens == len(A) + len(B)  # b was stored whole


def test_a_kept_output_is_reused_inside_the_segment_that_wraps_it_and_its_header_computed(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    # A's author generated A[2:] after its own prompt (its rows 30..35 there); every reader's
    # segment "a" wraps it in a 2-token header.
    author = ExactPages(executor, [*range(90, 120), *A[2:]])
    body = torch.arange(30, 30 + len(A) - 2)
    k, v = author.read(None, body)
    recovery.segments.keep_output(SALT, A[2:], k, v, 30)
    ids, spans = prompt("ab")
    outcome, _, work = run(recovery, executor, ids, spans, NONE)
    assert outcome.report.reused_tokens == len(A) - 2  # b is stored nowhere: computed
    assert outcome.report.computed_tokens == (work.end - work.start) - (len(A) - 2)
    a = span(spans, "a")
    moved = rerotate_keys(k, body, torch.arange(a.start + 2, a.end), executor.config)
    rows = slice(a.start + 2 - work.start, a.end - work.start)
    torch.testing.assert_close(outcome.k[:, rows], moved, atol=1e-5, rtol=1e-4)
    assert torch.equal(outcome.v[:, rows], v)
    # a held reused rows, so this reader does not file it as a first reader: the next one
    # reuses the author's KV too (b it stored whole).
    later, _, _ = run(recovery, executor, *prompt("ba", private="y"), NONE, request_id="r2")
    assert later.report.reused_tokens == len(A) - 2 + len(B)
    other, _, _ = run(recovery, executor, ids, spans, NONE, tenant="kmesh-approx:other")
    assert other.report.reused_tokens == 0  # kept outputs stay in their tenant


def test_policy_full_recomputes_reused_segments_exactly(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    run(recovery, executor, *prompt("ab"), NONE)
    ids, spans = prompt("ba", private="y")
    outcome, pages, work = run(recovery, executor, ids, spans, RecoverySpec(policy="full"))
    assert outcome.report.reused_tokens == 0
    torch.testing.assert_close(outcome.k, pages.k[:, work.start : work.end], atol=1e-5, rtol=1e-4)


def test_the_gate_leaves_a_deviating_region_to_vllm(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    run(recovery, executor, *prompt("ab"), NONE)
    ids, spans = prompt("ba", private="y")
    spec = RecoverySpec(policy="none", gate=0.0)
    outcome, _, _ = run(recovery, executor, ids, spans, spec, request_id="r2")
    assert outcome.report.fell_back and outcome.report.deviation > 0
    assert outcome.k is None and outcome.v is None


def test_stored_segments_never_cross_tenants(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    run(recovery, executor, *prompt("ab"), NONE)
    ids, spans = prompt("ba", private="y")
    outcome, _, _ = run(recovery, executor, ids, spans, NONE, tenant="kmesh-approx:other")
    assert outcome.report.reused_tokens == 0


@pytest.mark.parametrize("master", ["sibling", "common"])
def test_a_round_builds_its_master_once_and_places_it_in_every_sibling(model, master):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    round_ = RoundSpec(id="r1", segments=["a", "b"], master=master)
    spec = RecoverySpec(policy="none", gate=None, round=round_)
    siblings = [prompt("ab"), prompt("ba", private="y")]
    jobs = [
        job(ids, spans, spec, request_id=f"s{i}", family="f", first_block=100 * i)
        for i, (ids, spans) in enumerate(siblings)
    ]

    class Pages:  # each sibling's own exact prefix, told apart by its block ids
        def read(self, block_ids, positions):
            work = next(w for w in jobs if w.block_ids == block_ids)
            return ExactPages(executor, work.token_ids).read(block_ids, positions)

    outcomes = recovered(recovery, jobs, Pages())
    first, second = outcomes["s0"].report, outcomes["s1"].report
    assert first.master_bytes > 0 and second.shared_computed_tokens == second.master_bytes == 0
    assert second.reused_tokens == len(A) + len(B)
    if master == "common":  # the system prompt (the common context) then a and b after it
        assert first.shared_computed_tokens == len(SYSTEM) + len(A) + len(B)
        assert first.reused_tokens == len(A) + len(B)
    else:  # the first sibling is computed exactly: its own KV is the master, nothing extra
        assert first.shared_computed_tokens == 0 and first.reused_tokens == 0
        assert first.computed_tokens == jobs[0].end - jobs[0].start
        exact = ExactPages(executor, jobs[0].token_ids)
        torch.testing.assert_close(
            outcomes["s0"].k, exact.k[:, jobs[0].start : jobs[0].end], atol=1e-5, rtol=1e-4
        )
    # Both siblings hold the master's KV of a, each at its own positions: equal after moving.
    a0, a1 = span(siblings[0][1], "a"), span(siblings[1][1], "a")
    k0 = outcomes["s0"].k[:, a0.start - BLOCK : a0.end - BLOCK]
    k1 = outcomes["s1"].k[:, a1.start - BLOCK : a1.end - BLOCK]
    moved = rerotate_keys(
        k0, torch.arange(a0.start, a0.end), torch.arange(a1.start, a1.end), executor.config
    )
    torch.testing.assert_close(k1, moved, atol=1e-5, rtol=1e-4)
    # A sibling arriving in a later step reuses the same master.
    later = job(*prompt("ab", private="y"), spec, request_id="s2", family="f")
    report = recovered(recovery, [later], ExactPages(executor, later.token_ids))["s2"].report
    assert report.master_bytes == 0 and report.reused_tokens == len(A) + len(B)


def test_a_master_sibling_computes_a_round_segment_reaching_past_the_claim_whole(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    spec = RecoverySpec(policy="none", gate=None, round=RoundSpec(id="r1", segments=["a", "b"]))
    ids, spans = prompt("ab", private="y", ask=[60])  # b ends past the claim
    work = job(ids, spans, spec, family="f")
    assert work.end < span(spans, "b").end
    outcome = recovered(recovery, [work], ExactPages(executor, ids))["r"]
    assert outcome.k is not None and outcome.k.shape[1] == work.end - work.start
    assert outcome.report.computed_tokens == span(spans, "b").end - work.start


def test_kept_state_stays_within_its_bound_least_recently_used_dropped_first(model):
    executor, fingerprint = model
    config = executor.config
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    recovery = RequestRecovery(executor, fingerprint, max_bytes=len(A) * per_token)  # one segment
    run(recovery, executor, *prompt("ab"), NONE)  # stores a, then b (a is dropped)
    assert recovery.ledger.total <= len(A) * per_token
    ids, spans = prompt("ba", private="y")
    outcome, _, _ = run(recovery, executor, ids, spans, NONE, request_id="r2")
    assert outcome.report.reused_tokens == len(B)  # b only: a is computed again


def test_a_dropped_master_is_built_again_by_the_rounds_next_sibling(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint, max_bytes=1)  # keeps only the latest item

    def sibling(round_id: str, request_id: str):
        spec = RecoverySpec(policy="none", gate=None, round=RoundSpec(id=round_id, segments=["a"]))
        work = job(*prompt("ab"), spec, request_id=request_id, family="f")
        return recovered(recovery, [work], ExactPages(executor, work.token_ids))[request_id].report

    assert sibling("r1", "s1").master_bytes > 0
    assert sibling("r2", "s2").master_bytes > 0  # drops r1's master
    assert sibling("r1", "s3").master_bytes > 0  # built again


def test_a_round_id_reused_over_other_outputs_builds_its_own_master(model):
    """The kept master is keyed by the round's tokens too: a sibling that names a round id
    another round used, over other outputs, gets no KV of those outputs."""
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    spec = RecoverySpec(policy="none", gate=None, round=RoundSpec(id="r1", segments=["a"]))

    def sibling(ids, spans, request_id):
        work = job(ids, spans, spec, request_id=request_id, family="f")
        return work, recovered(recovery, [work], ExactPages(executor, ids))[request_id]

    ids, spans = prompt("ab")
    assert sibling(ids, spans, "s1")[1].report.master_bytes > 0
    a = span(spans, "a")
    other = ids[: a.start] + [t + 100 for t in ids[a.start : a.end]] + ids[a.end :]
    work, outcome = sibling(other, spans, "s2")
    assert outcome.report.master_bytes > 0 and outcome.report.reused_tokens == 0
    exact = ExactPages(executor, other)
    torch.testing.assert_close(outcome.k, exact.k[:, work.start : work.end], atol=1e-5, rtol=1e-4)
    # The same outputs again: the round's master is reused.
    assert sibling(other, spans, "s3")[1].report.reused_tokens == len(A)


def test_a_siblings_claim_starts_after_the_kept_trunk_tail_whose_rows_it_takes_as_they_are(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint, page_size=BLOCK)
    first_ids, first_spans = prompt("ab")  # the trunk (SYSTEM, 5 tokens) ends inside page 1
    first = job(first_ids, first_spans, NONE, start=0)
    first_out = recovered(recovery, [first], ExactPages(executor, first_ids))["r"]
    ids, spans = prompt("ba", private="y")
    second = job(ids, spans, NONE, request_id="r2", first_block=10)
    outcome = recovered(recovery, [second], ExactPages(executor, ids))["r2"]
    assert outcome.report.tail_tokens == len(SYSTEM) - BLOCK
    assert outcome.k is not None and first_out.k is not None
    assert torch.equal(outcome.k[:, :1], first_out.k[:, BLOCK : len(SYSTEM)])
    # The rest of the claim is recovered after the tail: the trunk's row 4, which the stored
    # segment would otherwise have placed (re-rotated), is the first sibling's row itself.
    assert outcome.k.shape[1] == second.end - second.start
    alone = RequestRecovery(executor, fingerprint)  # keeps no tails; the same stored segments
    recovered(alone, [first], ExactPages(executor, first_ids))
    without = recovered(alone, [job(ids, spans, NONE, request_id="r3")], ExactPages(executor, ids))[
        "r3"
    ]
    assert outcome.report.reused_tokens == without.report.reused_tokens - 1
    assert outcome.report.computed_tokens == without.report.computed_tokens


def test_a_round_sibling_continues_its_own_previous_prompt_from_its_kept_tail(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint, page_size=BLOCK)
    earlier_ids, earlier_spans = prompt("a", private="y")  # ... a ends at 18, then the ask
    earlier = job(earlier_ids, earlier_spans, NONE, start=0)
    recovered(recovery, [earlier], ExactPages(executor, earlier_ids))
    # The next prompt continues it before its ask: its page hit ends at 16, the tail is 16, 17.
    ids, spans = prompt("ab", private="y")
    spec = RecoverySpec(policy="none", gate=None, round=RoundSpec(id="r1", segments=["b"]))
    sibling = job(ids, spans, spec, start=16, request_id="s", family="f")
    outcome = recovered(recovery, [sibling], ExactPages(executor, ids))["s"]
    assert outcome.report.tail_tokens == 2 and outcome.k is not None
    assert outcome.k.shape[1] == sibling.end - sibling.start


def test_each_outcome_is_written_before_a_later_job_of_the_step_reads_its_prefix(model):
    executor, fingerprint = model
    recovery = RequestRecovery(executor, fingerprint)
    events: list[str] = []

    class Pages(ExactPages):
        def read(self, block_ids, positions):
            events.append(f"read {block_ids[0]}")
            return super().read(block_ids, positions)

    ids, spans = prompt("ab")
    jobs = [job(ids, spans, NONE, request_id=f"r{i}", first_block=10 * i) for i in (1, 2)]
    recovery.run(
        jobs, Pages(executor, ids), lambda job, _: events.append(f"write {job.request_id}")
    )
    assert events == ["read 10", "write r1", "read 20", "write r2"]


def test_a_round_too_large_for_one_batch_is_recovered_in_batches_around_one_master(
    model, monkeypatch
):
    executor, fingerprint = model
    spec = RecoverySpec(policy="none", gate=None, round=RoundSpec(id="r1", segments=["a", "b"]))
    siblings = [prompt(order, private) for order in ("ab", "ba") for private in ("x", "y")]
    jobs = [
        job(ids, spans, spec, request_id=f"s{i}", family="f", first_block=100 * i)
        for i, (ids, spans) in enumerate(siblings)
    ]

    class Pages:
        def read(self, block_ids, positions):
            work = next(w for w in jobs if w.block_ids == block_ids)
            return ExactPages(executor, work.token_ids).read(block_ids, positions)

    whole = recovered(RequestRecovery(executor, fingerprint), jobs, Pages())
    written: list[str] = []
    monkeypatch.setattr("kmesh.recovery.requests.ROUND_BATCH_TOKENS", 2 * (jobs[0].end - BLOCK))
    assert len(_chunks(jobs)) >= 2
    batched = recovered(
        RequestRecovery(executor, fingerprint),
        jobs,
        Pages(),
        lambda work, _: written.append(work.request_id),
    )
    assert written == ["s0", "s1", "s2", "s3"]  # every batch written before the next
    assert [batched[w.request_id].report.master_bytes > 0 for w in jobs] == [1, 0, 0, 0]
    for work in jobs:
        torch.testing.assert_close(batched[work.request_id].k, whole[work.request_id].k)
        assert batched[work.request_id].report == whole[work.request_id].report


def test_a_steps_jobs_that_reuse_what_its_first_reader_stores_are_recovered_in_one_batch(
    model, monkeypatch
):
    import kmesh.recovery.requests as requests

    executor, fingerprint = model
    batches: list[int] = []
    real = requests.recover

    def counting(executor, regions, cfg):
        batches.append(len(regions))
        return real(executor, regions, cfg)

    monkeypatch.setattr(requests, "recover", counting)
    readers = [prompt("ab"), prompt("ba", private="y"), prompt("ab", private="y")]
    jobs = [
        job(ids, spans, NONE, request_id=f"r{i}", first_block=10 * i)
        for i, (ids, spans) in enumerate(readers)
    ]
    batched = RequestRecovery(executor, fingerprint, page_size=BLOCK)
    pages = {j.request_id: ExactPages(executor, j.token_ids) for j in jobs}

    class StepPages:
        def read(self, block_ids, positions):
            return pages[f"r{block_ids[0] // 10}"].read(block_ids, positions)

    got = recovered(batched, jobs, StepPages())
    assert batches == [1, 2]  # the first reader alone, then both readers of what it stored
    assert [got[j.request_id].report.reused_tokens for j in jobs] == [0, 16, 16]
    one_at_a_time = RequestRecovery(executor, fingerprint)
    for j in jobs:
        alone = recovered(one_at_a_time, [j], pages[j.request_id])[j.request_id]
        torch.testing.assert_close(got[j.request_id].k, alone.k, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got[j.request_id].v, alone.v, atol=1e-5, rtol=1e-4)
