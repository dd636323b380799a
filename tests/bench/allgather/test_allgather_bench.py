"""The All-Gather benchmark's plumbing on the tiny model and a synthetic trace."""

from dataclasses import replace

import pytest

from kmesh.bench.allgather.config import STRATEGIES, AllGatherBenchConfig
from kmesh.bench.allgather.run import AllGatherBench
from kmesh.recovery import quality
from kmesh.recovery.quality import Calibration
from tests.conftest import synthetic_allgather_turns

EXACT_KL = 1e-6  # fp32 with different reduction orders; a real difference is > 1e-3 here


@pytest.fixture(scope="module")
def turns():
    return synthetic_allgather_turns(agents=3, rounds=3)


def _report(tiny, turns, **options):
    """The tiny model's random weights deviate at any layer: no gate unless a test asks."""
    executor, fingerprint = tiny
    cfg = AllGatherBenchConfig(block_size=4, greedy_tokens=6, **{"gate": None, **options})
    return AllGatherBench(executor, fingerprint, turns, cfg).report()


def test_policy_full_reproduces_full_prefill(tiny, turns):
    report = _report(tiny, turns, policy="full", agent_ratio=1.0)
    assert list(report["strategies"]) == list(STRATEGIES)
    for name in STRATEGIES:
        quality = report["strategies"][name]["quality"]
        assert quality["kl_mean"] < EXACT_KL, name
        assert quality["top1_agreement"] == 1.0 and quality["greedy_match_32"] == 1.0, name
        assert quality["samples"] == 6  # 3 agents x rounds 1 and 2
    assert report["strategies"]["collective"]["restore_bit_identical"]


def test_reuse_without_recovery_is_visible_and_cheaper(tiny, turns):
    # The common master recovered from the authors' KV without recomputation (shared ratio 0).
    report = _report(
        tiny, turns, policy="none", master="common", recompute_ratio=0.0, shared_ratio=0.0
    )
    runs = report["strategies"]
    assert runs["prefix"]["quality"]["kl_mean"] < EXACT_KL
    assert runs["per_request"]["quality"]["kl_mean"] > 1e-3
    computed = {name: runs[name]["computed_tokens"] for name in STRATEGIES}
    assert computed["full"] > computed["prefix"] > computed["per_request"]
    assert computed["collective"] < computed["per_request"]
    assert runs["collective"]["restore_bit_identical"]
    assert runs["collective"]["kv_bytes_per_agent"] < runs["per_request"]["kv_bytes_per_agent"]


@pytest.mark.parametrize(("master", "fallbacks"), [("sibling", 4), ("common", 6 + 2)])
def test_the_quality_gate_sends_every_reused_region_to_full_recomputation(
    tiny, turns, master, fallbacks
):
    report = _report(
        tiny, turns, policy="none", master=master, recompute_ratio=0.0, shared_ratio=0.0, gate=0.0
    )
    runs = report["strategies"]
    # Rounds 1 and 2, 3 agents each. The master sibling is computed exactly (never gated): 2
    # mirrored agents per round fall back. The common choice's shared step, recovered at a ratio
    # below 1, is gated too (once per round), and all 3 agents are mirrored.
    assert runs["per_request"]["fallbacks"] == 6
    assert runs["collective"]["fallbacks"] == fallbacks
    for name in ("per_request", "collective"):
        assert runs[name]["quality"]["kl_mean"] < EXACT_KL, name


def test_the_sibling_master_costs_nothing_beyond_the_first_agents_own_prefill(tiny, turns):
    report = _report(tiny, turns, policy="none", agent_ratio=0.0)
    collective = report["strategies"]["collective"]
    for r in (1, 2):
        agent_0 = next(t for t in turns if t.round == r and t.agent == 0)
        before = next(t for t in turns if t.round == r - 1 and t.agent == 0)
        transcript = len(before.prompt.token_ids) - len(before.prompt.segments[-1].token_ids)
        asks = sum(len(t.prompt.segments[-1].token_ids) for t in turns if t.round == r)
        own = len(agent_0.prompt.token_ids) - transcript  # the master sibling's whole region
        expected = own + asks - len(agent_0.prompt.segments[-1].token_ids)
        assert collective["per_round"][r]["computed_tokens"] == pytest.approx(expected)
    assert collective["restore_bit_identical"]


def test_new_tokens_count_each_unseen_segment_once(tiny, turns):
    report = _report(tiny, turns, policy="none")
    new = report["config"]["new_tokens_per_round"]
    first = {s.token_ids for t in turns if t.round == 0 for s in t.prompt.segments}
    assert new[0] == sum(len(tokens) for tokens in first)
    for r in (1, 2):
        outputs = sum(len(b.output_ids) + 4 for b in turns if b.round == r - 1)  # header + close
        asks = sum(len(t.prompt.segments[-1].token_ids) for t in turns if t.round == r)
        assert new[r] == outputs + asks
    # Without correction the sibling master computes each new output once (in agent 0's
    # region) and every agent its own instruction: exactly the new tokens.
    last = report["comparison"]["last_round_computed_over_new"]
    assert last["collective"] == 1.0 < last["prefix"] < last["full"]


def test_accounting_in_token_layers(tiny, turns):
    report = _report(tiny, turns, policy="kv_deviation", recompute_ratio=0.5, agent_ratio=0.5)
    runs = report["strategies"]
    prompt_tokens = sum(len(t.prompt.token_ids) for t in turns)
    assert runs["full"]["computed_tokens"] == prompt_tokens
    for name in STRATEGIES:
        rounds = runs[name]["per_round"]
        assert len(rounds) == 3
        total = sum(r["computed_tokens"] for r in rounds)
        assert total == pytest.approx(runs[name]["computed_tokens"], abs=0.05)


def test_a_trace_that_is_not_all_gather_is_refused(tiny, turns):
    executor, fingerprint = tiny
    with pytest.raises(ValueError, match="one turn per agent"):
        AllGatherBench(executor, fingerprint, turns[:-1], AllGatherBenchConfig())


def test_the_sweep_varies_each_variants_own_knob(tiny, turns):
    executor, fingerprint = tiny
    cfg = AllGatherBenchConfig(block_size=4, greedy_tokens=4, gate=None)
    rows = AllGatherBench(executor, fingerprint, turns, cfg).sweep(["kv_deviation"], [0.0, 1.0])
    computed = {(r["strategy"], r["ratio"]): r["computed_tokens"] for r in rows}
    for variant in ("per_request", "collective", "collective_shared"):
        assert computed[(variant, 0.0)] < computed[(variant, 1.0)], variant


def test_a_quality_target_runs_its_calibrated_knobs_or_exactly(tiny, turns, monkeypatch):
    executor, fingerprint = tiny
    cfg = AllGatherBenchConfig(block_size=4, greedy_tokens=4, gate=None, quality="greedy")
    bench = AllGatherBench(executor, fingerprint, turns, cfg)
    prefix = bench.run("prefix")
    for name in ("per_request", "collective"):  # no calibration of the tiny model: exact
        run = bench.run(name)
        assert run.name == name and run.extra["quality_served"] == "exact"
        assert run.computed == prefix.computed and run.greedy == prefix.greedy
    served = Calibration(fingerprint, "round", "c", 0.0, "sibling", None, 0.0, 1.0, 0.5)
    monkeypatch.setattr(quality, "CALIBRATIONS", (served,))
    run = bench.run("collective")  # the calibrated knobs: agent ratio 0, no gate
    plain = bench.run_at("collective", replace(cfg, quality=None, agent_ratio=0.0))
    assert "quality_served" not in run.extra and run.computed == plain.computed
    assert run.computed_tokens < prefix.computed_tokens
