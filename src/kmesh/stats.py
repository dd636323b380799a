"""What engines report about requests and about their load, named once for every server.

`kmesh serve` (kmesh/serve/metrics.py) and KMeshConnector inside a plain vLLM server
(kmesh/vllm/metrics.py) keep the same counters of finished requests; both serve backends and
vLLM's stat-logger hook (kmesh/vllm/load_logger.py) report the engine's load as an EngineLoad.
Pure data: no I/O, no Prometheus.
"""

from dataclasses import dataclass
from typing import Any

TOKEN_KINDS = ("prompt", "generation", "computed", "reused", "restored", "recovered")
RECOVERY_KINDS = ("computed", "reused")
# The counters kmesh serve and KMeshConnector inside vLLM (kmesh/vllm/metrics.py) both keep:
# name -> help. kmesh_tokens and kmesh_recovery_tokens have a `kind` label.
COUNTERS = {
    "kmesh_tokens": "Tokens of finished requests: prompt, generation, and the prompt's split "
    "(computed, reused from the local prefix cache, restored from the store, recovered by "
    "KMesh's executor).",
    "kmesh_recovery_tokens": "What recovered rows cost: computed by KMesh's executor "
    "(token-equivalents: a row recomputed in some layers counts its share), or reused from "
    "stored KV.",
    "kmesh_recovery_fallbacks": "Recoveries the quality gate (or a failure) handed back to the "
    "engine's own prefill.",
    "kmesh_round_masters": "Round masters built: a round's first sibling computed exactly, or "
    "its outputs recovered in the family's common context (once per family and round unless "
    "recovery's byte bound dropped the master).",
}


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """What one finished request adds to the counters."""

    tokens: dict[str, float]  # TOKEN_KINDS
    recovery: dict[str, float]  # RECOVERY_KINDS
    fallbacks: int
    masters: int  # round masters this request built (0 or 1)


def request_counts(stats: dict[str, Any]) -> RequestCounts:
    """The counts of a finished request's kmesh stats (with completion_tokens)."""
    tokens = {
        "prompt": stats.get("prompt_tokens", 0),
        "generation": stats.get("completion_tokens", 0),
    }
    for kind in TOKEN_KINDS[2:]:
        tokens[kind] = stats.get(f"{kind}_tokens", 0)
    recovery = stats.get("recovery")
    if not isinstance(recovery, dict):
        return RequestCounts(tokens, dict.fromkeys(RECOVERY_KINDS, 0.0), 0, 0)
    spent = {kind: recovery.get(f"{kind}_tokens", 0) for kind in RECOVERY_KINDS}
    fallbacks = int(bool(recovery.get("fell_back")))
    return RequestCounts(tokens, spent, fallbacks, int(recovery.get("master_bytes", 0) > 0))


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine is doing now (GET /metrics, GET /health)."""

    running: int  # requests being computed
    waiting: int  # requests queued for room
    # Share of the KV cache held by live or retained requests (cached free blocks not counted).
    kv_usage: float
    # Token positions run through the model since the start (prefill, decode, recovery).
    computed_tokens: int
