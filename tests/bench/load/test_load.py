"""`kmesh bench load`'s pieces without a server: the plain mix, the judging of answers and the
report's figures."""

import random

import pytest

from kmesh.bench.load.run import KEY_A, ExchangeResult, LoadConfig, report, slope_per_minute
from kmesh.workloads.serve_traffic import PLAIN_KINDS, next_exchange

KEYS = ("key-a", "key-b")


def test_the_plain_mix_holds_only_what_any_openai_server_takes():
    rng = random.Random(0)
    cfg = LoadConfig("vllm-vanilla", clients=1, seconds=1, mix="plain")
    exchanges = [next_exchange(rng, cfg.keys, i, cfg.kinds) for i in range(200)]
    assert {e.kind for e in exchanges} == set(PLAIN_KINDS) and cfg.keys == (KEY_A,)
    assert all("kmesh" not in e.body for e in exchanges)


def test_a_slope_is_per_minute_and_zero_when_flat():
    assert slope_per_minute([(0.0, 5.0), (60.0, 5.0), (120.0, 5.0)]) == 0
    assert slope_per_minute([(0.0, 0.0), (30.0, 1.0), (60.0, 2.0)]) == pytest.approx(2.0)
    assert slope_per_minute([(0.0, 1.0)]) == 0


def test_the_report_counts_failures_by_kind_and_reads_latency_from_served_requests():
    cfg = LoadConfig("reference", clients=2, seconds=120)
    served = ExchangeResult("plain", 200, None, 0.5, 1.0, "text")
    outcomes = [
        (next_exchange(random.Random(i), KEYS, i), outcome)
        for i, outcome in enumerate(
            [served] * 8
            + [
                ExchangeResult("plain", 503, "http_5xx", 0.1, 0.1),
                ExchangeResult("bad_body", 200, "unexpected_status", 0.2, 0.2, "x"),
            ]
        )
    ]
    samples = [{"t": t, "rss_mib": 100.0 + t / 60, "store_mib": 0.0} for t in (0, 30, 60, 90, 120)]
    wrong = [{"kind": "plain", "served": "a", "cold": "b"}]
    result = report(
        cfg, {"outcomes": outcomes, "samples": samples}, {"checked": 5, "wrong": wrong}, None, ""
    )
    assert result["requests"] == 10
    assert result["failures"] == {"http_5xx": 1, "unexpected_status": 1}
    assert result["wrong_exact"] == 1 and result["checked_exact"] == 5
    assert result["latency_s"]["total_p50"] == 1.0
    assert result["rss_slope_mib_per_min"] == pytest.approx(1.0)  # after the warm-up only
