"""`GET /metrics`: KMesh's counters in Prometheus text (src/kmesh/serve/metrics.py)."""

from prometheus_client.parser import text_string_to_metric_families

from kmesh.serve.metrics import ServeMetrics
from kmesh.stats import EngineLoad

IDLE = EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)


def samples(metrics: ServeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_served_request_counts_its_tokens_and_their_split():
    metrics = ServeMetrics(lambda: IDLE)
    stats = {
        "prompt_tokens": 100,
        "completion_tokens": 8,
        "computed_tokens": 30,
        "reused_tokens": 64,
        "restored_tokens": 0,
        "recovered_tokens": 6,
        "recovery": {"fell_back": True, "computed_tokens": 6, "reused_tokens": 0},
    }
    metrics.served("POST /v1/completions", stats, 0.5)
    recovery = {"fell_back": False, "computed_tokens": 1.5, "reused_tokens": 4, "master_bytes": 9}
    metrics.served("POST /v1/completions", {**stats, "recovery": recovery}, 0.5)
    got = samples(metrics)
    route = (("route", "POST /v1/completions"), ("status", "200"))
    assert got[("kmesh_requests_total", route)] == 2
    for kind, count in (("prompt", 200), ("generation", 16), ("computed", 60), ("reused", 128)):
        assert got[("kmesh_tokens_total", (("kind", kind),))] == count
    assert got[("kmesh_tokens_total", (("kind", "recovered"),))] == 12
    assert got[("kmesh_recovery_fallbacks_total", ())] == 1
    assert got[("kmesh_round_masters_total", ())] == 1  # the second built a master
    assert got[("kmesh_recovery_tokens_total", (("kind", "computed"),))] == 7.5
    assert got[("kmesh_recovery_tokens_total", (("kind", "reused"),))] == 4
    assert got[("kmesh_request_seconds_count", ())] == 2


def test_a_refused_request_counts_under_its_status_only():
    metrics = ServeMetrics(lambda: IDLE)
    metrics.refused("POST /v1/chat/completions", 400)
    got = samples(metrics)
    route = (("route", "POST /v1/chat/completions"), ("status", "400"))
    assert got[("kmesh_requests_total", route)] == 1
    assert not any(name == "kmesh_tokens_total" for name, _ in got)


def test_the_engines_load_is_read_at_each_scrape():
    loads = iter([EngineLoad(2, 1, 0.25, 300), EngineLoad(0, 0, 0.0, 340)])
    metrics = ServeMetrics(lambda: next(loads))
    first, second = samples(metrics), samples(metrics)
    assert first[("kmesh_engine_running_requests", ())] == 2
    assert first[("kmesh_engine_waiting_requests", ())] == 1
    assert first[("kmesh_engine_kv_usage", ())] == 0.25
    assert first[("kmesh_engine_computed_tokens_total", ())] == 300
    assert second[("kmesh_engine_running_requests", ())] == 0
    assert second[("kmesh_engine_computed_tokens_total", ())] == 340
