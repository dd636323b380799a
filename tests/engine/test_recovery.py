"""Recovery inside the reference engine (Request.recovery): what is engine-specific. The round
mechanism itself is tested once, for both engines, in tests/recovery/test_collective.py and
tests/recovery/test_requests.py."""

from dataclasses import replace

import pytest

from kmesh.engine.request import Request, SamplingParams
from kmesh.errors import InvalidRequestError
from kmesh.recovery import quality
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.recovery.quality import Calibration
from kmesh.state.recovery_meta import RecoverySpec, RoundSpec
from kmesh.state.request_meta import KMeshParams
from kmesh.state.segments import Role, Span
from kmesh.store import StoreClient
from tests.conftest import random_tokens

GREEDY = SamplingParams(max_tokens=8)
SALT = "kmesh-approx:test"
SYSTEM = random_tokens(20, seed=1)
OUTPUTS = {
    "a": random_tokens(24, seed=2),
    "b": random_tokens(30, seed=3),
    "c": random_tokens(19, seed=8),
    "d": random_tokens(26, seed=9),
}
ASK = random_tokens(5, seed=4)
PRIVATE = {0: random_tokens(6, seed=5), 1: random_tokens(11, seed=6), 2: random_tokens(3, seed=7)}


def sibling(
    agent: int, order: str, spec: RecoverySpec, salt: str | None = SALT, then: str = ""
) -> Request:
    """Agent's prompt: the system, its persona, the round's outputs in `order`, then (a later
    round) the next round's outputs in `then`, and the instruction."""
    parts = [("system", "shared", SYSTEM), (f"p{agent}", "private", PRIVATE[agent])]
    parts += [(name, "shared", OUTPUTS[name]) for name in order + then]
    parts.append((f"ask{len(then)}", "instruction", ASK))
    ids: list[int] = []
    spans = []
    for name, role, tokens in parts:
        spans.append(Span(len(ids), len(ids) + len(tokens), Role(role), name))
        ids.extend(tokens)
    recovery = RecoveryRequest(tuple(spans), spec, "council")
    return Request(f"agent-{agent}-{then}", tuple(ids), GREEDY, salt, recovery=recovery)


def plain(request: Request, salt: str | None = None) -> Request:
    return Request(request.request_id, request.prompt_ids, GREEDY, salt)


ROUND = RoundSpec(id="r1", segments=["a", "b"])


def test_policy_full_gives_the_engines_own_greedy_tokens(make_tiny_engine):
    spec = RecoverySpec(policy="full")
    requests = [sibling(0, "ab", spec, salt=None), sibling(1, "ba", spec, salt=None)]
    recovered = make_tiny_engine().generate(requests)
    exact = make_tiny_engine().generate([plain(r) for r in requests])
    for got, want in zip(recovered, exact, strict=True):
        assert got.output_ids == want.output_ids
        report = got.stats.recovery
        assert report is not None and "refused" not in report
        # Every prompt row but the last is filled by recovery; the engine computes the last.
        assert report["computed_tokens"] == len(got.prompt_ids) - 1
        assert got.stats.computed_tokens == 1


def test_a_round_is_recovered_once_and_mirrored_into_every_sibling(make_tiny_engine):
    engine = make_tiny_engine()
    spec = RecoverySpec(policy="none", gate=None, round=ROUND)
    outs = engine.generate([sibling(0, "ab", spec), sibling(1, "ba", spec), sibling(2, "ba", spec)])
    first, *others = (o.stats.recovery for o in outs)
    assert first is not None and first["master_bytes"] > 0 and first["reused_tokens"] == 0
    for out, report in zip(outs[1:], others, strict=True):
        assert report is not None and report["master_bytes"] == 0
        assert report["reused_tokens"] == len(OUTPUTS["a"]) + len(OUTPUTS["b"])
        # Only the sibling's own tokens are computed (all but the last, which the engine does).
        assert report["computed_tokens"] == len(out.prompt_ids) - 1 - report["reused_tokens"]


def test_approximate_recovery_without_an_approximate_salt_is_refused_and_exact(make_tiny_engine):
    spec = RecoverySpec(policy="none", gate=None, round=ROUND)
    requests = [sibling(0, "ab", spec, salt=None), sibling(1, "ba", spec, salt=None)]
    outs = make_tiny_engine().generate(requests)
    exact = make_tiny_engine().generate([plain(r) for r in requests])
    for got, want in zip(outs, exact, strict=True):
        assert got.stats.recovery is not None and "refused" in got.stats.recovery
        assert got.output_ids == want.output_ids


def test_approximate_blocks_never_reach_an_exact_request(make_tiny_engine):
    engine = make_tiny_engine()
    spec = RecoverySpec(policy="none", gate=None, round=ROUND)
    engine.generate([sibling(0, "ab", spec), sibling(1, "ba", spec)])
    again = engine.generate([plain(sibling(1, "ba", spec), salt=None)])[0]
    assert again.stats.reused_tokens == 0
    assert (
        again.output_ids
        == make_tiny_engine().generate([plain(sibling(1, "ba", spec))])[0].output_ids
    )


def test_the_gate_leaves_a_deviating_sibling_to_the_engines_prefill(make_tiny_engine):
    spec = RecoverySpec(policy="none", gate=0.0, round=ROUND)
    requests = [sibling(0, "ab", spec), sibling(1, "ba", spec)]
    outs = make_tiny_engine().generate(requests)
    report = outs[1].stats.recovery
    assert report is not None and report["fell_back"]
    assert outs[1].stats.computed_tokens == len(outs[1].prompt_ids)
    exact = make_tiny_engine().generate([plain(r) for r in requests])
    assert outs[1].output_ids == exact[1].output_ids


def test_a_round_without_a_family_or_with_unknown_segments_is_refused(make_tiny_engine):
    engine = make_tiny_engine()
    request = sibling(0, "ab", RecoverySpec(policy="none", round=ROUND))
    assert request.recovery is not None
    orphan = Request(
        "x",
        request.prompt_ids,
        GREEDY,
        SALT,
        recovery=RecoveryRequest(request.recovery.spans, request.recovery.spec, None),
    )
    with pytest.raises(InvalidRequestError, match="needs a family"):
        engine.add_request(orphan)
    unknown = RecoverySpec(policy="none", round=RoundSpec(id="r", segments=["zz"]))
    stray = Request(
        "y",
        request.prompt_ids,
        GREEDY,
        SALT,
        recovery=RecoveryRequest(request.recovery.spans, unknown, "f"),
    )
    with pytest.raises(InvalidRequestError, match="no span has"):
        engine.add_request(stray)


def test_a_recovery_that_raises_leaves_its_rows_to_the_step_and_the_engine_serving(
    make_tiny_engine, monkeypatch, caplog
):
    """As vLLM's worker does (kmesh/vllm/worker_side.py): a failed recovery is logged and its
    requests are computed in full, the engine's own greedy tokens; later requests are served."""
    from kmesh.recovery.requests import RequestRecovery

    spec = RecoverySpec(policy="full")
    requests = [sibling(0, "ab", spec, salt=None), sibling(1, "ba", spec, salt=None)]
    engine = make_tiny_engine()
    run = RequestRecovery.run

    def write_one_then_raise(self, jobs, pages, write):
        run(self, jobs[:1], pages, write)  # the first job's rows are written, then it fails
        raise ValueError("a recovery bug")

    monkeypatch.setattr(RequestRecovery, "run", write_one_then_raise)
    with caplog.at_level("WARNING", logger="kmesh.engine.runner"):
        failed = engine.generate(requests)
    assert "recovery failed, the step computes the claimed tokens: a recovery bug" in caplog.text
    exact = make_tiny_engine().generate([plain(r) for r in requests])
    for got, want in zip(failed, exact, strict=True):
        assert got.output_ids == want.output_ids
        assert got.stats.recovery is None and got.stats.recovered_tokens == 0
        assert got.stats.computed_tokens == len(got.prompt_ids)
    monkeypatch.setattr(RequestRecovery, "run", run)
    [again] = engine.generate([replace(requests[0], request_id="again")])
    assert again.output_ids == exact[0].output_ids and again.stats.recovery is not None


def test_a_kept_output_is_reused_by_a_later_readers_recovery(make_tiny_engine):
    engine = make_tiny_engine()
    author = Request("author", tuple(SYSTEM), GREEDY, SALT, keep_output=True)
    written = engine.generate([author])[0]
    said = written.output_ids
    assert written.stats.kept_output_tokens == len(said) - 1
    header = random_tokens(3, seed=8)
    ids = [*PRIVATE[0], *header, *said, *ASK]
    spans = (
        Span(0, len(PRIVATE[0]), Role.PRIVATE, "p0"),
        Span(len(PRIVATE[0]), len(PRIVATE[0]) + len(header) + len(said), Role.SHARED, "said"),
        Span(len(ids) - len(ASK), len(ids), Role.INSTRUCTION, "ask"),
    )
    spec = RecoverySpec(policy="none", gate=None)
    reader = Request(
        "reader", tuple(ids), GREEDY, SALT, recovery=RecoveryRequest(spans, spec, None)
    )
    report = engine.generate([reader])[0].stats.recovery
    assert report is not None and report["reused_tokens"] == len(said) - 1  # the last: no KV
    elsewhere = Request(
        "elsewhere",
        tuple(ids),
        GREEDY,
        "kmesh-approx:other",
        recovery=RecoveryRequest(spans, spec, None),
    )
    other = engine.generate([elsewhere])[0].stats.recovery
    assert other is not None and other["reused_tokens"] == 0  # kept outputs stay in their tenant


def test_a_round_spread_over_two_engines_on_one_store_mirrors_one_master(
    make_tiny_engine, store_factory
):
    """Engine A runs the round's first sibling and publishes the master it built; engine B,
    another engine on the same store, mirrors it into the others instead of building its own:
    their outputs are those of one engine running the whole round."""
    spec = RecoverySpec(policy="none", gate=None, round=ROUND)
    requests = [sibling(0, "ab", spec), sibling(1, "ba", spec), sibling(2, "ba", spec)]
    one = make_tiny_engine().generate(requests)
    store = store_factory(capacity="64M")
    first, second = make_tiny_engine(store=store.socket), make_tiny_engine(store=store.socket)
    try:
        [built] = first.generate(requests[:1])
        rest = second.generate(requests[1:])
    finally:
        first.close()
        second.close()
    assert built.stats.recovery is not None and built.stats.recovery["master_bytes"] > 0
    assert [o.output_ids for o in [built, *rest]] == [o.output_ids for o in one]
    for got, want in zip(rest, one[1:], strict=True):
        report, expected = got.stats.recovery, want.stats.recovery
        assert report is not None and expected is not None
        assert report["master_bytes"] == 0  # B built none: it mirrored A's
        assert report["reused_tokens"] == expected["reused_tokens"] > 0


def test_a_master_is_shared_only_within_its_tenant(make_tiny_engine, store_factory):
    spec = RecoverySpec(policy="none", gate=None, round=ROUND)
    store = store_factory(capacity="64M")
    first, second = make_tiny_engine(store=store.socket), make_tiny_engine(store=store.socket)
    try:
        first.generate([sibling(0, "ab", spec)])
        [other] = second.generate([sibling(1, "ba", spec, salt="kmesh-approx:another")])
    finally:
        first.close()
        second.close()
    report = other.stats.recovery
    assert report is not None and report["master_bytes"] > 0 and report["reused_tokens"] == 0


def test_a_transcript_recovered_on_one_engine_is_restored_on_another_with_its_greedy_tokens(
    make_tiny_engine, store_factory
):
    """Engine A runs round 1, then agent 1's round 2 (publishing each transcript); engine B, a
    fresh engine on the same store, runs agent 1's round 2 again: it restores the transcript
    instead of recovering it, and its greedy tokens are A's. Another tenant restores nothing."""
    first_round = RecoverySpec(policy="none", gate=None, round=ROUND)
    second_round = RecoverySpec(
        policy="none", gate=None, round=RoundSpec(id="r2", segments=["c", "d"])
    )
    store = store_factory(capacity="64M")
    first, second = make_tiny_engine(store=store.socket), make_tiny_engine(store=store.socket)
    try:
        first.generate([sibling(0, "ab", first_round), sibling(1, "ba", first_round)])
        [on_first] = first.generate([sibling(1, "ba", second_round, then="cd")])
        [on_second] = second.generate([sibling(1, "ba", second_round, then="cd")])
        elsewhere = sibling(1, "ba", second_round, salt="kmesh-approx:another", then="cd")
        [other] = second.generate([elsewhere])
    finally:
        first.close()
        second.close()
    assert on_second.output_ids == on_first.output_ids
    report = on_second.stats.recovery
    assert report is not None and on_second.stats.reused_tokens == 0
    # Everything before its instruction comes from the store (whole blocks through the block
    # store, the transcript's rows past them through its pieces); it computes the instruction.
    instruction = len(on_second.prompt_ids) - len(ASK)
    assert report["restored_tokens"] > 0 and report["restored_bytes"] > 0
    assert on_second.stats.restored_tokens + report["restored_tokens"] == instruction
    assert report["computed_tokens"] == len(ASK) - 1
    assert other.stats.recovery is not None and other.stats.recovery["restored_tokens"] == 0


def test_a_segment_one_engine_read_first_is_reused_by_another_on_the_same_store(
    make_tiny_engine, store_factory
):
    """Per-request recovery: engine A computes the shared outputs as their first reader and
    publishes them; engine B re-rotates them into its own prompt instead of computing them. A
    cold engine, and another tenant on the same store, compute them."""
    spec = RecoverySpec(policy="none", gate=None)
    store = store_factory(capacity="64M")
    first, second = make_tiny_engine(store=store.socket), make_tiny_engine(store=store.socket)
    try:
        first.generate([sibling(0, "ab", spec)])
        [reader] = second.generate([sibling(1, "ba", spec)])
        [other] = second.generate([sibling(2, "ba", spec, salt="kmesh-approx:another")])
    finally:
        first.close()
        second.close()
    [cold] = make_tiny_engine().generate([sibling(1, "ba", spec)])
    shared = len(OUTPUTS["a"]) + len(OUTPUTS["b"])
    for out, reused in ((reader, shared), (cold, 0), (other, 0)):
        assert out.stats.recovery is not None
        assert out.stats.recovery["reused_tokens"] == reused


def test_a_declared_next_use_pins_the_transcript_until_the_family_closes(
    make_tiny_engine, store_factory
):
    """With a store, a round's members that declare their next use have their transcripts
    pinned for the family (the same family pins as vLLM's, store/family_pins.py); a member
    carrying `close` ends the family and its pins at once."""
    spec = RecoverySpec(policy="none", gate=None, round=ROUND)
    store = store_factory(capacity="64M")
    engine = make_tiny_engine(store=store.socket)

    def declared(request: Request, **kmesh: object) -> Request:
        params = KMeshParams(family="council", recovery={"policy": "full"}, **kmesh)
        return replace(request, kmesh=params)

    try:
        engine.generate([declared(sibling(0, "ab", spec), next_use=3.0), sibling(1, "ba", spec)])
        with StoreClient(store.socket) as client:
            pinned = client.stats()["pinned"]
            assert pinned > 0  # the declared member's pieces and its round's master
            engine.generate([declared(sibling(2, "ab", spec), next_use=4.0)])
            assert client.stats()["pinned"] >= pinned  # the family is open
            engine.generate([declared(sibling(2, "ab", spec, then="cd"), close=True)])
            assert client.stats()["pinned"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("target", ["exact", "greedy"])
def test_a_quality_target_the_engine_cannot_meet_is_served_exactly_and_says_so(
    make_tiny_engine, target
):
    # The tiny model has no calibrations: greedy falls back to exact, under any salt.
    spec = RecoverySpec(quality=target, round=ROUND)
    requests = [sibling(0, "ab", spec), sibling(1, "ba", spec)]
    outs = make_tiny_engine().generate(requests)
    exact = make_tiny_engine().generate([plain(r) for r in requests])
    for got, want in zip(outs, exact, strict=True):
        assert got.output_ids == want.output_ids
        assert got.stats.recovery is None and got.stats.recovered_tokens == 0
        assert got.stats.quality is not None and got.stats.quality["served"] == "exact"
        assert ("reason" in got.stats.quality) == (target != "exact")


def test_a_met_quality_target_is_served_by_its_calibrated_setting(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    served = Calibration(engine.fingerprint, "round", "none@0", 0.0, "sibling", None, 0.0, 1.0, 0.5)
    monkeypatch.setattr(quality, "CALIBRATIONS", (served,))
    spec = RecoverySpec(quality="greedy", gate=None, round=ROUND)
    outs = engine.generate([sibling(0, "ab", spec), sibling(1, "ba", spec)])
    for out in outs:
        assert out.stats.quality == {"target": "greedy", "served": "none@0"}
        assert out.stats.recovery is not None and "refused" not in out.stats.recovery
    assert outs[1].stats.recovery["reused_tokens"] == len(OUTPUTS["a"]) + len(OUTPUTS["b"])
