"""`GET /metrics` of `kmesh serve`: Prometheus text (prometheus-client), one registry per app.

Counted per finished request (kmesh.serve.app): requests by route and HTTP status, prompt and
generated tokens, and KMesh's split of the prompt tokens (computed, reused from the local prefix
cache, restored from the store, recovered by KMesh's executor), recoveries that fell back to the
engine's own prefill, and request seconds. A request refused before it ran counts only in
`kmesh_requests_total`.
"""

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The stats a finished request reports (kmesh/serve/backend.py::Delta.stats) that are counted.
PROMPT_SPLIT = ("computed_tokens", "reused_tokens", "restored_tokens", "recovered_tokens")


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kmesh_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "kmesh_tokens",
            "Tokens of finished requests: prompt, generation, and the prompt's split "
            "(computed, reused, restored, recovered).",
            ["kind"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kmesh_recovery_fallbacks",
            "Recoveries the quality gate (or a failure) handed back to the engine's own prefill.",
            registry=self.registry,
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
        for kind, name in (("prompt", "prompt_tokens"), ("generation", "completion_tokens")):
            self.tokens.labels(kind).inc(stats.get(name, 0))
        for name in PROMPT_SPLIT:
            self.tokens.labels(name.removesuffix("_tokens")).inc(stats.get(name, 0))
        recovery = stats.get("recovery")
        if isinstance(recovery, dict) and recovery.get("fell_back"):
            self.fallbacks.inc()

    def refused(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
