"""`kmesh bench round` on the tiny model: every strategy timed, and each one's computed tokens
what its recovery must compute (checked against the round's own arithmetic)."""

from kmesh.bench.round.config import RoundBenchConfig
from kmesh.bench.round.run import COLLECTIVE, build_round, run_round_bench

CONFIG = RoundBenchConfig(siblings=3, segment_tokens=20, trunk_tokens=24, ask_tokens=5, repeats=1)


def test_each_sibling_reads_every_segment_in_its_own_order_after_the_trunk(tiny):
    executor, _ = tiny
    siblings, batch = build_round(executor, CONFIG)
    region = CONFIG.siblings * CONFIG.segment_tokens + CONFIG.ask_tokens
    assert [len(s.token_ids) for s in siblings] == [region] * CONFIG.siblings
    assert all(s.start == CONFIG.trunk_tokens for s in siblings)
    # Sibling s reads segment (i + s) mod S at place i: the same tokens at other positions.
    first, second = siblings[0], siblings[1]
    lo, hi = second.spans[1]
    assert lo == CONFIG.trunk_tokens
    assert second.token_ids[: hi - lo].tolist() == first.token_ids[20:40].tolist()
    assert [int(b.positions[0]) for b in batch] == [CONFIG.trunk_tokens] * CONFIG.siblings


def test_the_report_times_prefill_and_each_collective_policy_at_its_cost(tiny):
    executor, _ = tiny
    report = run_round_bench(executor, "tiny", CONFIG, lambda _: None)
    rows = {row["strategy"]: row for row in report["rows"]}
    assert list(rows) == ["prefill"] + [f"collective {p}@{r}" for p, r in COLLECTIVE]
    region = CONFIG.siblings * CONFIG.segment_tokens + CONFIG.ask_tokens
    assert report["region_tokens"] == CONFIG.siblings * region
    assert rows["prefill"]["computed_tokens"] == CONFIG.siblings * region
    # The master sibling is computed whole; the others compute their ask, and nothing more
    # under none, everything under full.
    others = CONFIG.siblings - 1
    assert rows["collective none@0.0"]["computed_tokens"] == region + others * CONFIG.ask_tokens
    assert rows["collective full@1.0"]["computed_tokens"] == CONFIG.siblings * region
    assert all(row["ms"] > 0 for row in rows.values())
    assert rows["prefill"]["relative_ms"] == 1.0
