"""`GET /metrics` of `kmesh serve`: Prometheus text (prometheus-client), one registry per app.

Counted per finished request (kmesh.serve.app): requests by route and HTTP status, prompt and
generated tokens, and KMesh's split of the prompt tokens (computed, reused from the local prefix
cache, restored from the store, recovered by KMesh's executor), what recovered rows cost,
recoveries that fell back to the engine's own prefill, round masters built, and request
seconds. A request refused
before it ran counts only in `kmesh_requests_total`. Read from the engine at each scrape: its
running and waiting requests, the share of its KV cache in use, and the tokens it has computed.
"""

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kmesh.stats import COUNTERS, EngineLoad, request_counts

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    def __init__(self, load: Callable[[], EngineLoad]) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        yield GaugeMetricFamily(
            "kmesh_engine_running_requests", "Requests being computed.", load.running
        )
        yield GaugeMetricFamily(
            "kmesh_engine_waiting_requests", "Requests queued for room.", load.waiting
        )
        yield GaugeMetricFamily(
            "kmesh_engine_kv_usage",
            "Share of the KV cache held by live or retained requests (0..1).",
            load.kv_usage,
        )
        yield CounterMetricFamily(
            "kmesh_engine_computed_tokens",
            "Token positions the engine ran through the model (prefill, decode, recovery).",
            load.computed_tokens,
        )


class ServeMetrics:
    def __init__(self, load: Callable[[], EngineLoad]) -> None:
        """`load`: the engine's current load (read at each scrape)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(load))
        self.requests = Counter(
            "kmesh_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "kmesh_tokens", COUNTERS["kmesh_tokens"], ["kind"], registry=self.registry
        )
        self.recovery = Counter(
            "kmesh_recovery_tokens",
            COUNTERS["kmesh_recovery_tokens"],
            ["kind"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kmesh_recovery_fallbacks", COUNTERS["kmesh_recovery_fallbacks"], registry=self.registry
        )
        self.masters = Counter(
            "kmesh_round_masters", COUNTERS["kmesh_round_masters"], registry=self.registry
        )
        self.seconds = Histogram(
            "kmesh_request_seconds",
            "Seconds from arrival to the last token.",
            registry=self.registry,
        )

    def served(self, route: str, stats: dict[str, Any], seconds: float) -> None:
        """A request that finished; `stats`: its kmesh stats and usage."""
        self.requests.labels(route, "200").inc()
        self.seconds.observe(seconds)
        counts = request_counts(stats)
        for kind, n in counts.tokens.items():
            self.tokens.labels(kind).inc(n)
        for kind, n in counts.recovery.items():
            self.recovery.labels(kind).inc(n)
        self.fallbacks.inc(counts.fallbacks)
        self.masters.inc(counts.masters)

    def refused(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
