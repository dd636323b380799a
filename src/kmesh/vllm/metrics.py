"""KMeshConnector's counters in vLLM's own metrics: the same kmesh_tokens, kmesh_recovery_tokens,
kmesh_recovery_fallbacks and kmesh_round_masters as `kmesh serve` (both named in kmesh/stats.py),
on a plain vLLM server's /metrics, with vLLM's model_name and engine labels.

vLLM's path (vllm/v1/core/sched/scheduler.py, vllm/v1/metrics/loggers.py): after each step the
scheduler asks the connector for stats (`get_kv_connector_stats`); the scheduler side hands the
requests that finished since (their kmesh stats are complete by then), summed into
`KMeshConnectorStats.data`; vLLM ships that dict to the front end, which gives it to
`KMeshPromMetrics.observe` (and, summed over its logging interval, to its log line).
"""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kmesh.stats import COUNTERS, RECOVERY_KINDS, TOKEN_KINDS, request_counts

# KMeshConnectorStats.data: flat sums, "tokens.<kind>", "recovery.<kind>", "fallbacks",
# "masters", "requests".
FIELDS = (
    *(f"tokens.{kind}" for kind in TOKEN_KINDS),
    *(f"recovery.{kind}" for kind in RECOVERY_KINDS),
    "fallbacks",
    "masters",
    "requests",
)
# The unlabelled counters: field -> counter name.
PLAIN_COUNTERS = {"fallbacks": "kmesh_recovery_fallbacks", "masters": "kmesh_round_masters"}


def finished_counts(finished: list[dict[str, Any]]) -> dict[str, float]:
    """KMeshConnectorStats.data of these finished requests' stats (with completion_tokens)."""
    data = dict.fromkeys(FIELDS, 0.0)
    for stats in finished:
        counts = request_counts(stats)
        for kind, n in counts.tokens.items():
            data[f"tokens.{kind}"] += n
        for kind, n in counts.recovery.items():
            data[f"recovery.{kind}"] += n
        data["fallbacks"] += counts.fallbacks
        data["masters"] += counts.masters
        data["requests"] += 1
    return data


class KMeshConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KMeshConnectorStats":
        if not self.data:
            return KMeshConnectorStats(dict(other.data))
        return KMeshConnectorStats({k: self.data.get(k, 0) + other.data.get(k, 0) for k in FIELDS})

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data.get("requests")


class KMeshPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[int, dict[str, Any]] = {i: {} for i in per_engine_labelvalues}
        for name, kinds, prefix in (
            ("kmesh_tokens", TOKEN_KINDS, "tokens."),
            ("kmesh_recovery_tokens", RECOVERY_KINDS, "recovery."),
        ):
            counter = self._counter_cls(
                name=name, documentation=COUNTERS[name], labelnames=[*labelnames, "kind"]
            )
            for engine, values in per_engine_labelvalues.items():
                for kind in kinds:
                    self._counters[engine][prefix + kind] = counter.labels(*values, kind)
        for field, name in PLAIN_COUNTERS.items():
            plain = self._counter_cls(
                name=name, documentation=COUNTERS[name], labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self._counters[engine][field] = plain.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field, counter in self._counters[engine_idx].items():
            counter.inc(transfer_stats_data.get(field, 0))
